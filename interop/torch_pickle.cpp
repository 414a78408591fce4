// PyTorch's pickles: the values a checkpoint holds, and the protocol-2 writer (the reader: torch_unpickle.cpp).
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include <fmt/core.h>

#include "common/status.h"
#include "interop/torch_format.h"

namespace ptk::torchfmt {

int64_t TensorRef::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- values ----------------------------------------------------------------------------------

const PyValue* PyValue::Get(std::string_view key) const {
  const PyValue* d = this;
  if (kind == Kind::kObject) {
    if (!state) return nullptr;
    d = state.get();
  }
  if (d->kind != Kind::kDict) return nullptr;
  for (const auto& [k, v] : d->dict)
    if (k->kind == Kind::kStr && k->s == key) return v.get();
  return nullptr;
}
std::string PyValue::ClassName() const { return callable ? callable->s : ""; }

namespace {
PyRef Make(PyValue::Kind k) {
  auto v = std::make_shared<PyValue>();
  v->kind = k;
  return v;
}
}  // namespace
PyRef MakeNone() { return Make(PyValue::Kind::kNone); }
PyRef MakeBool(bool b) {
  auto v = Make(PyValue::Kind::kBool);
  v->b = b;
  return v;
}
PyRef MakeInt(int64_t i) {
  auto v = Make(PyValue::Kind::kInt);
  v->i = i;
  return v;
}
PyRef MakeFloat(double f) {
  auto v = Make(PyValue::Kind::kFloat);
  v->f = f;
  return v;
}
PyRef MakeStr(std::string s) {
  auto v = Make(PyValue::Kind::kStr);
  v->s = std::move(s);
  return v;
}
PyRef MakeList(std::vector<PyRef> items) {
  auto v = Make(PyValue::Kind::kList);
  v->items = std::move(items);
  return v;
}
PyRef MakeTuple(std::vector<PyRef> items) {
  auto v = Make(PyValue::Kind::kTuple);
  v->items = std::move(items);
  return v;
}
PyRef MakeDict() { return Make(PyValue::Kind::kDict); }
PyRef MakeGlobal(std::string name) {
  auto v = Make(PyValue::Kind::kGlobal);
  v->s = std::move(name);
  return v;
}
PyRef MakeNamespace(PyRef attrs) {
  auto v = Make(PyValue::Kind::kObject);
  v->callable = MakeGlobal("argparse.Namespace");
  v->state = std::move(attrs);
  return v;
}
void DictSet(PyValue* dict, PyRef key, PyRef value) { dict->dict.emplace_back(std::move(key), std::move(value)); }
void DictSet(PyValue* dict, std::string key, PyRef value) { DictSet(dict, MakeStr(std::move(key)), std::move(value)); }

PyRef MakeTensor(const std::string& key, DType dtype, std::vector<int64_t> shape) {
  auto v = Make(PyValue::Kind::kTensor);
  TensorRef& t = v->tensor;
  t.storage_key = key;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.stride.assign(t.shape.size(), 1);
  for (size_t i = t.shape.size(); i-- > 1;) t.stride[i - 1] = t.stride[i] * t.shape[i];
  t.storage_numel = t.numel();
  return v;
}

StorageBlob MakeBlob(const std::string& key, DType dtype, const float* data, int64_t n) {
  StorageBlob b;
  b.key = key;
  b.dtype = dtype;
  b.bytes.resize(static_cast<size_t>(n) * DTypeSize(dtype));
  if (dtype == DType::kFloat32) {
    std::memcpy(b.bytes.data(), data, b.bytes.size());
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = dtype == DType::kBFloat16 ? FloatToBf16(data[i]) : FloatToHalf(data[i]);
      std::memcpy(b.bytes.data() + 2 * i, &h, 2);
    }
  }
  return b;
}

// ---- the pickle writer -----------------------------------------------------------------------
namespace {

class Pickler {
 public:
  std::string Run(const PyValue& root) {
    out_ += "\x80\x02";
    Put(root);
    out_ += '.';
    return std::move(out_);
  }

 private:
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xFF);
  }
  void Global(const std::string& dotted) {
    const size_t dot = dotted.rfind('.');
    // torch._utils._rebuild_tensor_v2 -> module torch._utils, name _rebuild_tensor_v2
    out_ += 'c';
    out_ += dotted.substr(0, dot) + "\n" + dotted.substr(dot + 1) + "\n";
  }
  void Int(int64_t v) {
    if (v >= 0 && v < 256) {
      out_ += 'K';
      out_ += static_cast<char>(v);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      U32(static_cast<uint32_t>(static_cast<int32_t>(v)));
    } else {
      out_ += '\x8a';
      out_ += '\x08';
      for (int i = 0; i < 8; ++i) out_ += static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xFF);
    }
  }
  void Str(const std::string& s) {
    out_ += 'X';
    U32(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  void Tuple(const std::vector<PyRef>& items) {
    if (items.empty()) {
      out_ += ')';
      return;
    }
    out_ += '(';
    for (const PyRef& i : items) Put(*i);
    out_ += 't';
  }
  void Put(const PyValue& v) {
    switch (v.kind) {
      case PyValue::Kind::kNone: out_ += 'N'; break;
      case PyValue::Kind::kBool: out_ += v.b ? '\x88' : '\x89'; break;
      case PyValue::Kind::kInt: Int(v.i); break;
      case PyValue::Kind::kFloat: {
        uint64_t u;
        std::memcpy(&u, &v.f, 8);
        out_ += 'G';
        for (int i = 7; i >= 0; --i) out_ += static_cast<char>((u >> (8 * i)) & 0xFF);
        break;
      }
      case PyValue::Kind::kStr: Str(v.s); break;
      case PyValue::Kind::kBytes:
        // Protocol 2 has no bytes opcode: torch.save's pickler writes _codecs.encode(latin1 text).
        Global("_codecs.encode");
        out_ += '(';
        {
          std::string latin1;
          for (unsigned char c : v.s) {
            if (c < 0x80) {
              latin1 += static_cast<char>(c);
            } else {
              latin1 += static_cast<char>(0xC0 | (c >> 6));
              latin1 += static_cast<char>(0x80 | (c & 0x3F));
            }
          }
          Str(latin1);
        }
        Str("latin1");
        out_ += "tR";
        break;
      case PyValue::Kind::kList:
        out_ += ']';
        if (!v.items.empty()) {
          out_ += '(';
          for (const PyRef& i : v.items) Put(*i);
          out_ += 'e';
        }
        break;
      case PyValue::Kind::kTuple: Tuple(v.items); break;
      case PyValue::Kind::kDict:
        out_ += '}';
        if (!v.dict.empty()) {
          out_ += '(';
          for (const auto& [k, val] : v.dict) {
            Put(*k);
            Put(*val);
          }
          out_ += 'u';
        }
        break;
      case PyValue::Kind::kGlobal: Global(v.s); break;
      case PyValue::Kind::kObject:
        Global(v.ClassName());
        Tuple(v.items);
        // argparse.Namespace and other plain classes: cls.__new__(cls) then __dict__ update.
        out_ += '\x81';
        if (v.state) {
          Put(*v.state);
          out_ += 'b';
        }
        break;
      case PyValue::Kind::kTensor: {
        const TensorRef& t = v.tensor;
        Global("torch._utils._rebuild_tensor_v2");
        out_ += '(';
        out_ += '(';
        Str("storage");
        Global("torch." + std::string(StorageTypeName(t.dtype)));
        Str(t.storage_key);
        Str("cpu");
        Int(t.storage_numel);
        out_ += 't';
        out_ += 'Q';
        Int(t.offset);
        std::vector<PyRef> shape, stride;
        for (int64_t d : t.shape) shape.push_back(MakeInt(d));
        for (int64_t d : t.stride) stride.push_back(MakeInt(d));
        Tuple(shape);
        Tuple(stride);
        out_ += '\x89';
        Global("collections.OrderedDict");
        out_ += ")R";
        out_ += "tR";
        break;
      }
    }
  }
  std::string out_;
};

}  // namespace

std::string WritePickle(const PyValue& root) { return Pickler().Run(root); }

}  // namespace ptk::torchfmt
