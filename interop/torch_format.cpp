// PyTorch's zip + pickle serialization, read (safely: nothing is executed) and written.
#include "interop/torch_format.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <set>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/status.h"

namespace ptk::torchfmt {

// ---- numbers ---------------------------------------------------------------------------------

uint32_t Crc32(const void* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}
uint16_t FloatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000;
  const uint32_t a = u & 0x7FFFFFFF;
  if (a > 0x7F800000) return static_cast<uint16_t>(sign | 0x7E00);
  if (a >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to infinity
  if (a < 0x38800000) {                                              // subnormal half (or zero)
    const float af = std::fabs(f);
    const float scaled = af * 16777216.0f;  // 2^24: units of the smallest subnormal
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  uint32_t r = a - 0x38000000;  // rebias the exponent
  r += 0xFFF + ((r >> 13) & 1);
  return static_cast<uint16_t>(sign | (r >> 13));
}

std::string_view DTypeName(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kBool: return "bool";
  }
  return "?";
}
int DTypeSize(DType d) {
  switch (d) {
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat64:
    case DType::kInt64: return 8;
    default: return 1;
  }
}
namespace {
// torch.<Name>Storage, the storage types persistent ids name.
struct StorageName {
  const char* name;
  DType dtype;
};
constexpr StorageName kStorages[] = {
    {"FloatStorage", DType::kFloat32},  {"HalfStorage", DType::kFloat16}, {"BFloat16Storage", DType::kBFloat16},
    {"DoubleStorage", DType::kFloat64}, {"ByteStorage", DType::kUInt8},   {"CharStorage", DType::kInt8},
    {"IntStorage", DType::kInt32},      {"LongStorage", DType::kInt64},   {"BoolStorage", DType::kBool},
};
const char* StorageNameOf(DType d) {
  for (const auto& s : kStorages)
    if (s.dtype == d) return s.name;
  return "FloatStorage";
}
}  // namespace

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

// ---- the pickle reader -----------------------------------------------------------------------
namespace {

// Modules whose globals may appear (as names only: nothing is ever called).
bool AllowedGlobal(const std::string& module, const std::string& name) {
  static const std::set<std::string> exact = {
      "collections.OrderedDict",
      "collections.defaultdict",
      "argparse.Namespace",
      "types.SimpleNamespace",
      "_codecs.encode",
      "builtins.set",
      "builtins.frozenset",
      "builtins.slice",
      "builtins.bytearray",
      "builtins.complex",
      "__builtin__.set",
      "__builtin__.frozenset",
      "copyreg._reconstructor",
      "builtins.object",
      "__builtin__.object",
      "io.BytesIO",
      "_io.BytesIO",
      "pathlib.PosixPath",
      "pathlib.Path",
      "enum.Enum",
  };
  if (exact.count(module + "." + name)) return true;
  for (const char* prefix : {"torch", "numpy", "megatron", "transformer_engine"}) {
    const size_t n = std::strlen(prefix);
    if (module.compare(0, n, prefix) == 0 && (module.size() == n || module[n] == '.')) return true;
  }
  return false;
}

class Unpickler {
 public:
  Unpickler(std::string_view data, const std::string& where) : d_(data), where_(where) {}

  absl::StatusOr<PyRef> Run() {
    while (true) {
      if (pos_ >= d_.size()) return Bad("ends before its STOP opcode (truncated)");
      op_at_ = pos_;
      const uint8_t op = static_cast<uint8_t>(d_[pos_++]);
      switch (op) {
        case 0x80: PTK_RETURN_IF_ERROR(Skip(1)); break;  // PROTO
        case 0x95: PTK_RETURN_IF_ERROR(Skip(8)); break;  // FRAME
        case '}': Push(MakeDict()); break;
        case ']': Push(MakeList()); break;
        case ')': Push(MakeTuple()); break;
        case 0x8f: Push(MakeList()); break;  // EMPTY_SET (kept as a list)
        case '(': marks_.push_back(stack_.size()); break;
        case 'X': PTK_RETURN_IF_ERROR(PushString(4, PyValue::Kind::kStr)); break;
        case 0x8c: PTK_RETURN_IF_ERROR(PushString(1, PyValue::Kind::kStr)); break;
        case 0x8d: PTK_RETURN_IF_ERROR(PushString(8, PyValue::Kind::kStr)); break;
        case 'T': PTK_RETURN_IF_ERROR(PushString(4, PyValue::Kind::kStr)); break;
        case 'U': PTK_RETURN_IF_ERROR(PushString(1, PyValue::Kind::kStr)); break;
        case 'B': PTK_RETURN_IF_ERROR(PushString(4, PyValue::Kind::kBytes)); break;
        case 'C': PTK_RETURN_IF_ERROR(PushString(1, PyValue::Kind::kBytes)); break;
        case 0x8e: PTK_RETURN_IF_ERROR(PushString(8, PyValue::Kind::kBytes)); break;
        case 'q': {
          PTK_ASSIGN_OR_RETURN(uint64_t k, Uint(1));
          PTK_RETURN_IF_ERROR(Put(k));
          break;
        }
        case 'r': {
          PTK_ASSIGN_OR_RETURN(uint64_t k, Uint(4));
          PTK_RETURN_IF_ERROR(Put(k));
          break;
        }
        case 0x94: PTK_RETURN_IF_ERROR(Put(memo_.size())); break;  // MEMOIZE
        case 'h':
        case 'j': {
          PTK_ASSIGN_OR_RETURN(uint64_t k, Uint(op == 'h' ? 1 : 4));
          auto it = memo_.find(k);
          if (it == memo_.end()) return Bad(fmt::format("GET of memo {} that was never PUT", k));
          Push(it->second);
          break;
        }
        case 'J': {
          PTK_ASSIGN_OR_RETURN(uint64_t u, Uint(4));
          Push(MakeInt(static_cast<int32_t>(static_cast<uint32_t>(u))));
          break;
        }
        case 'K':
        case 'M': {
          PTK_ASSIGN_OR_RETURN(uint64_t u, Uint(op == 'K' ? 1 : 2));
          Push(MakeInt(static_cast<int64_t>(u)));
          break;
        }
        case 0x8a:
        case 0x8b: {
          PTK_ASSIGN_OR_RETURN(uint64_t n, Uint(op == 0x8a ? 1 : 4));
          PTK_ASSIGN_OR_RETURN(std::string_view b, Take(n));
          if (n > 8) {  // beyond 64 bits: kept as its bytes (no weight or count is such a number)
            auto v = Make(PyValue::Kind::kBytes);
            v->s = std::string(b);
            Push(v);
            break;
          }
          uint64_t u = 0;
          for (size_t i = 0; i < n; ++i) u |= static_cast<uint64_t>(static_cast<uint8_t>(b[i])) << (8 * i);
          if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) u |= ~uint64_t{0} << (8 * n);
          Push(MakeInt(static_cast<int64_t>(u)));
          break;
        }
        case 'G': {
          PTK_ASSIGN_OR_RETURN(std::string_view b, Take(8));
          uint64_t u = 0;
          for (int i = 0; i < 8; ++i) u = (u << 8) | static_cast<uint8_t>(b[i]);
          double f;
          std::memcpy(&f, &u, 8);
          Push(MakeFloat(f));
          break;
        }
        case 0x88: Push(MakeBool(true)); break;
        case 0x89: Push(MakeBool(false)); break;
        case 'N': Push(MakeNone()); break;
        case 't': {
          PTK_ASSIGN_OR_RETURN(std::vector<PyRef> items, PopMark());
          Push(MakeTuple(std::move(items)));
          break;
        }
        case 0x85:
        case 0x86:
        case 0x87: {
          const size_t n = op - 0x84;
          if (stack_.size() < n + Floor()) return Bad("TUPLE on a short stack");
          std::vector<PyRef> items(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          Push(MakeTuple(std::move(items)));
          break;
        }
        case 's': {
          if (stack_.size() < 3 + Floor()) return Bad("SETITEM on a short stack");
          PyRef v = Pop(), k = Pop();
          PTK_RETURN_IF_ERROR(SetItem(stack_.back().get(), k, v));
          break;
        }
        case 'u': {
          PTK_ASSIGN_OR_RETURN(std::vector<PyRef> items, PopMark());
          if (items.size() % 2 || stack_.empty()) return Bad("SETITEMS with an odd number of items");
          for (size_t i = 0; i < items.size(); i += 2)
            PTK_RETURN_IF_ERROR(SetItem(stack_.back().get(), items[i], items[i + 1]));
          break;
        }
        case 'a': {
          if (stack_.size() < 2 + Floor()) return Bad("APPEND on a short stack");
          PyRef v = Pop();
          PTK_RETURN_IF_ERROR(Append(stack_.back().get(), {v}));
          break;
        }
        case 'e':
        case 0x90: {  // APPENDS, ADDITEMS
          PTK_ASSIGN_OR_RETURN(std::vector<PyRef> items, PopMark());
          if (stack_.empty()) return Bad("APPENDS on an empty stack");
          PTK_RETURN_IF_ERROR(Append(stack_.back().get(), items));
          break;
        }
        case 0x91: {  // FROZENSET
          PTK_ASSIGN_OR_RETURN(std::vector<PyRef> items, PopMark());
          Push(MakeList(std::move(items)));
          break;
        }
        case 'c': {
          PTK_ASSIGN_OR_RETURN(std::string module, Line());
          PTK_ASSIGN_OR_RETURN(std::string name, Line());
          PTK_RETURN_IF_ERROR(PushGlobal(module, name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          if (stack_.size() < 2 + Floor()) return Bad("STACK_GLOBAL on a short stack");
          PyRef name = Pop(), module = Pop();
          if (name->kind != PyValue::Kind::kStr || module->kind != PyValue::Kind::kStr)
            return Bad("STACK_GLOBAL of non-strings");
          PTK_RETURN_IF_ERROR(PushGlobal(module->s, name->s));
          break;
        }
        case 'R': {
          if (stack_.size() < 2 + Floor()) return Bad("REDUCE on a short stack");
          PyRef args = Pop(), fn = Pop();
          if (args->kind != PyValue::Kind::kTuple) return Bad("REDUCE with arguments that are not a tuple");
          PTK_ASSIGN_OR_RETURN(PyRef v, Call(fn, args->items));
          Push(v);
          break;
        }
        case 0x81: {  // NEWOBJ
          if (stack_.size() < 2 + Floor()) return Bad("NEWOBJ on a short stack");
          PyRef args = Pop(), cls = Pop();
          if (args->kind != PyValue::Kind::kTuple) return Bad("NEWOBJ with arguments that are not a tuple");
          PTK_ASSIGN_OR_RETURN(PyRef v, Call(cls, args->items));
          Push(v);
          break;
        }
        case 0x92: {  // NEWOBJ_EX
          if (stack_.size() < 3 + Floor()) return Bad("NEWOBJ_EX on a short stack");
          Pop();
          PyRef args = Pop(), cls = Pop();
          PTK_ASSIGN_OR_RETURN(PyRef v, Call(cls, args->items));
          Push(v);
          break;
        }
        case 'b': {
          if (stack_.size() < 2 + Floor()) return Bad("BUILD on a short stack");
          PyRef state = Pop();
          PyValue* obj = stack_.back().get();
          if (obj->kind == PyValue::Kind::kObject) {
            obj->state = state;
          } else if (obj->kind == PyValue::Kind::kDict && state->kind == PyValue::Kind::kDict) {
            for (auto& kv : state->dict) obj->dict.push_back(kv);
          }  // a tensor's BUILD (its Python attributes): nothing ptk reads
          break;
        }
        case 'Q': {  // BINPERSID
          if (stack_.size() < 1 + Floor()) return Bad("BINPERSID on an empty stack");
          PTK_ASSIGN_OR_RETURN(PyRef v, Persistent(Pop()));
          Push(v);
          break;
        }
        case '0':
          if (stack_.size() < 1 + Floor()) return Bad("POP on an empty stack");
          Pop();
          break;
        case '1': {
          PTK_ASSIGN_OR_RETURN(std::vector<PyRef> unused, PopMark());
          break;
        }
        case '2':
          if (stack_.empty()) return Bad("DUP on an empty stack");
          Push(stack_.back());
          break;
        case '.':
          if (stack_.size() != 1 || !marks_.empty()) return Bad("STOP with a stack that is not one value");
          return stack_.back();
        default:
          return Bad(fmt::format("opcode 0x{:02x} ({:?}) is not one torch.save writes; refusing to read further", op,
                                 std::string(1, static_cast<char>(op >= 0x20 && op < 0x7f ? op : '?'))));
      }
    }
  }

 private:
  absl::Status Bad(const std::string& why) const {
    return absl::DataLossError(fmt::format("{}: byte {}: {}", where_, op_at_, why));
  }
  size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  void Push(PyRef v) { stack_.push_back(std::move(v)); }
  PyRef Pop() {
    PyRef v = stack_.back();
    stack_.pop_back();
    return v;
  }
  absl::Status Skip(size_t n) { return Take(n).status(); }
  absl::StatusOr<std::string_view> Take(uint64_t n) {
    if (n > d_.size() - pos_) return Bad("runs past the end of the pickle (truncated)");
    std::string_view v = d_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  absl::StatusOr<uint64_t> Uint(int n) {
    PTK_ASSIGN_OR_RETURN(std::string_view b, Take(n));
    uint64_t u = 0;
    for (int i = 0; i < n; ++i) u |= static_cast<uint64_t>(static_cast<uint8_t>(b[i])) << (8 * i);
    return u;
  }
  absl::StatusOr<std::string> Line() {
    const size_t nl = d_.find('\n', pos_);
    if (nl == std::string_view::npos) return Bad("GLOBAL without its newline (truncated)");
    std::string s(d_.substr(pos_, nl - pos_));
    pos_ = nl + 1;
    return s;
  }
  absl::Status PushString(int len_bytes, PyValue::Kind kind) {
    PTK_ASSIGN_OR_RETURN(uint64_t n, Uint(len_bytes));
    PTK_ASSIGN_OR_RETURN(std::string_view s, Take(n));
    auto v = Make(kind);
    v->s = std::string(s);
    Push(v);
    return absl::OkStatus();
  }
  absl::Status Put(uint64_t k) {
    if (stack_.empty()) return Bad("PUT on an empty stack");
    memo_[k] = stack_.back();
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<PyRef>> PopMark() {
    if (marks_.empty()) return Bad("no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyRef> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  absl::Status SetItem(PyValue* target, PyRef k, PyRef v) {
    if (target->kind == PyValue::Kind::kObject) {  // an OrderedDict subclass, a defaultdict: its items
      if (!target->state) target->state = MakeDict();
      target = target->state.get();
    }
    if (target->kind != PyValue::Kind::kDict) return Bad("SETITEM on something that is not a dict");
    target->dict.emplace_back(std::move(k), std::move(v));
    return absl::OkStatus();
  }
  absl::Status Append(PyValue* target, const std::vector<PyRef>& items) {
    if (target->kind != PyValue::Kind::kList) return Bad("APPEND on something that is not a list");
    target->items.insert(target->items.end(), items.begin(), items.end());
    return absl::OkStatus();
  }
  absl::Status PushGlobal(const std::string& module, const std::string& name) {
    if (!AllowedGlobal(module, name))
      return Bad(fmt::format("unknown global {}.{}: not one a PyTorch or Megatron checkpoint holds; refusing the file",
                             module, name));
    Push(MakeGlobal(module + "." + name));
    return absl::OkStatus();
  }
  // A call, recorded (never made); torch's rebuild functions and OrderedDict become values.
  absl::StatusOr<PyRef> Call(const PyRef& fn, const std::vector<PyRef>& args) {
    if (fn->kind != PyValue::Kind::kGlobal) return Bad("a call of something that is not a global");
    const std::string& f = fn->s;
    if (f == "collections.OrderedDict" && args.empty()) return MakeDict();
    if (f == "torch._utils._rebuild_tensor_v2" || f == "torch._utils._rebuild_tensor") {
      if (args.size() < 4 || args[0]->kind != PyValue::Kind::kTensor || !args[1]->IsInt() ||
          args[2]->kind != PyValue::Kind::kTuple || args[3]->kind != PyValue::Kind::kTuple)
        return Bad(f + " with arguments other than (storage, offset, size, stride, ...)");
      auto v = Make(PyValue::Kind::kTensor);
      v->tensor = args[0]->tensor;
      v->tensor.offset = args[1]->i;
      for (const PyRef& d : args[2]->items) {
        if (!d->IsInt() || d->i < 0) return Bad(f + ": a size that is not a non-negative integer");
        v->tensor.shape.push_back(d->i);
      }
      for (const PyRef& d : args[3]->items) {
        if (!d->IsInt() || d->i < 0) return Bad(f + ": a stride that is not a non-negative integer");
        v->tensor.stride.push_back(d->i);
      }
      if (v->tensor.shape.size() != v->tensor.stride.size()) return Bad(f + ": size and stride differ in length");
      return v;
    }
    if ((f == "torch._utils._rebuild_parameter" || f == "torch._utils._rebuild_parameter_with_state") &&
        !args.empty() && args[0]->kind == PyValue::Kind::kTensor)
      return args[0];
    auto v = Make(PyValue::Kind::kObject);
    v->callable = fn;
    v->items = args;
    return v;
  }
  // ('storage', torch.<Type>Storage, key, location, numel): a storage in the archive.
  absl::StatusOr<PyRef> Persistent(const PyRef& pid) {
    const auto& it = pid->items;
    if (pid->kind != PyValue::Kind::kTuple || it.size() < 5 || it[0]->kind != PyValue::Kind::kStr ||
        it[0]->s != "storage" || it[1]->kind != PyValue::Kind::kGlobal || it[2]->kind != PyValue::Kind::kStr ||
        !it[4]->IsInt())
      return Bad("a persistent id other than ('storage', type, key, location, numel)");
    auto v = Make(PyValue::Kind::kTensor);
    const std::string& type = it[1]->s;
    bool known = false;
    for (const auto& s : kStorages)
      if (type == std::string("torch.") + s.name) {
        v->tensor.dtype = s.dtype;
        known = true;
      }
    if (!known) return Bad(fmt::format("storage type {} is not one ptk reads", type));
    v->tensor.storage_key = it[2]->s;
    v->tensor.storage_numel = it[4]->i;
    return v;
  }

  std::string_view d_;
  const std::string& where_;
  size_t pos_ = 0, op_at_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, PyRef> memo_;
};

}  // namespace

absl::StatusOr<PyRef> ParsePickle(std::string_view data, const std::string& where) {
  return Unpickler(data, where).Run();
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
        Global(std::string("torch.") + StorageNameOf(t.dtype));
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

// ---- the zip archive -------------------------------------------------------------------------
namespace {

uint64_t Le(const uint8_t* p, int n) {
  uint64_t u = 0;
  for (int i = 0; i < n; ++i) u |= static_cast<uint64_t>(p[i]) << (8 * i);
  return u;
}
void PutLe(std::string* out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEndSig = 0x06054b50;
constexpr uint32_t kEnd64Sig = 0x06064b50, kLocator64Sig = 0x07064b50;
constexpr uint64_t kAlign = 64;

}  // namespace

absl::StatusOr<std::unique_ptr<TorchArchiveReader>> TorchArchiveReader::Open(const std::string& path) {
  auto r = std::unique_ptr<TorchArchiveReader>(new TorchArchiveReader());
  r->path_ = path;
  PTK_ASSIGN_OR_RETURN(r->file_, MappedFile::Open(path));
  r->base_ = r->file_->data();
  r->size_ = r->file_->size();
  PTK_RETURN_IF_ERROR(r->Init());
  return r;
}

absl::StatusOr<std::unique_ptr<TorchArchiveReader>> TorchArchiveReader::OpenBytes(const std::string& where,
                                                                                  std::string_view bytes) {
  auto r = std::unique_ptr<TorchArchiveReader>(new TorchArchiveReader());
  r->path_ = where;
  r->base_ = reinterpret_cast<const uint8_t*>(bytes.data());
  r->size_ = bytes.size();
  PTK_RETURN_IF_ERROR(r->Init());
  return r;
}

absl::Status TorchArchiveReader::Init() {
  TorchArchiveReader* r = this;
  const std::string& path = path_;
  const uint8_t* d = base_;
  const uint64_t size = size_;
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: not a readable PyTorch file: {}", path, why));
  };
  // The end-of-central-directory record: the last 22 bytes, or before a comment of up to 64 KiB.
  if (size < 22) return bad(fmt::format("{} bytes, too short for a zip archive (truncated?)", size));
  int64_t eocd = -1;
  for (int64_t p = static_cast<int64_t>(size) - 22; p >= 0 && p >= static_cast<int64_t>(size) - 22 - 65535; --p)
    if (Le(d + p, 4) == kEndSig) {
      eocd = p;
      break;
    }
  if (eocd < 0) return bad("no zip end-of-central-directory record (truncated or not a torch.save file)");
  uint64_t count = Le(d + eocd + 10, 2), cd_size = Le(d + eocd + 12, 4), cd_off = Le(d + eocd + 16, 4);
  if (eocd >= 20 && Le(d + eocd - 20, 4) == kLocator64Sig) {
    const uint64_t z = Le(d + eocd - 20 + 8, 8);
    if (z + 56 > size || Le(d + z, 4) != kEnd64Sig) return bad("damaged zip64 end record");
    count = Le(d + z + 32, 8);
    cd_size = Le(d + z + 40, 8);
    cd_off = Le(d + z + 48, 8);
  }
  if (cd_off > size || cd_size > size - cd_off) return bad("the central directory lies past the end (truncated)");
  uint64_t p = cd_off;
  for (uint64_t i = 0; i < count; ++i) {
    if (p + 46 > cd_off + cd_size || Le(d + p, 4) != kCentralSig) return bad("damaged central directory");
    const uint64_t method = Le(d + p + 10, 2), crc = Le(d + p + 16, 4);
    uint64_t csize = Le(d + p + 20, 4), usize = Le(d + p + 24, 4);
    const uint64_t nlen = Le(d + p + 28, 2), xlen = Le(d + p + 30, 2), clen = Le(d + p + 32, 2);
    uint64_t local = Le(d + p + 42, 4);
    if (p + 46 + nlen + xlen + clen > cd_off + cd_size) return bad("damaged central directory");
    std::string name(reinterpret_cast<const char*>(d + p + 46), nlen);
    // zip64 extra: the 64-bit values of the fields that read 0xFFFFFFFF, in this order.
    for (uint64_t x = p + 46 + nlen; x + 4 <= p + 46 + nlen + xlen;) {
      const uint64_t id = Le(d + x, 2), len = Le(d + x + 2, 2);
      if (id == 1) {
        uint64_t q = x + 4;
        if (usize == 0xFFFFFFFF && q + 8 <= x + 4 + len) usize = Le(d + q, 8), q += 8;
        if (csize == 0xFFFFFFFF && q + 8 <= x + 4 + len) csize = Le(d + q, 8), q += 8;
        if (local == 0xFFFFFFFF && q + 8 <= x + 4 + len) local = Le(d + q, 8);
      }
      x += 4 + len;
    }
    if (method != 0)
      return bad(fmt::format("entry {} is compressed (method {}); torch.save stores entries", name, method));
    if (local + 30 > size || Le(d + local, 4) != kLocalSig)
      return bad(fmt::format("entry {}: damaged local header", name));
    const uint64_t data = local + 30 + Le(d + local + 26, 2) + Le(d + local + 28, 2);
    if (data > size || usize > size - data)
      return bad(fmt::format("entry {} runs past the end of the file ({} bytes; truncated)", name, size));
    r->entries_[name] = Entry{data, usize, static_cast<uint32_t>(crc), false};
    p += 46 + nlen + xlen + clen;
  }
  for (const auto& [name, e] : r->entries_) {
    const size_t at = name.rfind("/data.pkl");
    if (at != std::string::npos && at + 9 == name.size() && name.find('/') == at) {
      r->prefix_ = name.substr(0, at + 1);
      break;
    }
  }
  if (r->prefix_.empty()) {
    if (r->entries_.count("data.pkl") == 0) return bad("no data.pkl in the archive");
  }
  PTK_ASSIGN_OR_RETURN(std::string_view pkl, r->EntryData("data.pkl"));
  PTK_ASSIGN_OR_RETURN(r->root_, ParsePickle(pkl, fmt::format("{}: {}data.pkl", path, r->prefix_)));
  return absl::OkStatus();
}

absl::StatusOr<std::string_view> TorchArchiveReader::EntryData(const std::string& name) {
  auto it = entries_.find(prefix_ + name);
  if (it == entries_.end())
    return absl::DataLossError(fmt::format("{}: the archive has no {}{}", path_, prefix_, name));
  Entry& e = it->second;
  std::string_view data(reinterpret_cast<const char*>(base_ + e.data_offset), e.size);
  if (!e.crc_checked) {
    if (Crc32(data.data(), data.size()) != e.crc)
      return absl::DataLossError(fmt::format("{}: {}{}: CRC-32 mismatch (a damaged file)", path_, prefix_, name));
    e.crc_checked = true;
  }
  return data;
}

absl::StatusOr<std::vector<float>> TorchArchiveReader::ReadFloat(const TensorRef& t, const std::string& name) {
  PTK_ASSIGN_OR_RETURN(std::string_view data, EntryData("data/" + t.storage_key));
  const int64_t n = t.numel(), es = DTypeSize(t.dtype);
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: tensor {}: {}", path_, name, why));
  };
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kBFloat16 && t.dtype != DType::kFloat16 &&
      t.dtype != DType::kFloat64)
    return bad(fmt::format("dtype {}, not a floating-point tensor", DTypeName(t.dtype)));
  int64_t last = t.offset;  // the furthest element the view reaches
  for (size_t i = 0; i < t.shape.size(); ++i)
    if (t.shape[i] > 0) last += (t.shape[i] - 1) * t.stride[i];
  if (n > 0 && (t.offset < 0 || (last + 1) * es > static_cast<int64_t>(data.size())))
    return bad(fmt::format("its view reaches element {} of a storage of {} bytes", last, data.size()));
  std::vector<float> out(static_cast<size_t>(n));
  std::vector<int64_t> idx(t.shape.size(), 0);
  int64_t src = t.offset;
  for (int64_t k = 0; k < n; ++k) {
    const char* p = data.data() + src * es;
    switch (t.dtype) {
      case DType::kFloat32: std::memcpy(&out[k], p, 4); break;
      case DType::kFloat64: {
        double v;
        std::memcpy(&v, p, 8);
        out[k] = static_cast<float>(v);
        break;
      }
      default: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        out[k] = t.dtype == DType::kBFloat16 ? Bf16ToFloat(h) : HalfToFloat(h);
      }
    }
    for (size_t i = idx.size(); i-- > 0;) {  // the next index, row-major
      src += t.stride[i];
      if (++idx[i] < t.shape[i]) break;
      src -= t.stride[i] * t.shape[i];
      idx[i] = 0;
    }
  }
  return out;
}

absl::Status WriteTorchFile(const std::string& path, const PyValue& root, const std::vector<StorageBlob>& storages,
                            bool force_zip64) {
  // The archive's name inside: "archive", as torch.save names it for a file object.
  const std::string prefix = "archive/";
  std::vector<std::pair<std::string, std::string_view>> files;
  const std::string pkl = WritePickle(root);
  files.emplace_back(prefix + "data.pkl", pkl);
  files.emplace_back(prefix + "byteorder", "little");
  for (const StorageBlob& b : storages) files.emplace_back(prefix + "data/" + b.key, b.bytes);
  files.emplace_back(prefix + "version", "3\n");
  PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(path));
  uint64_t pos = 0;
  std::string central;
  for (const auto& [name, data] : files) {
    const uint32_t crc = Crc32(data.data(), data.size());
    const bool z64 = force_zip64 || data.size() >= 0xFFFFFFFFull || pos >= 0xFFFFFFFFull;
    std::string h;
    PutLe(&h, kLocalSig, 4);
    PutLe(&h, z64 ? 45 : 20, 2);  // version needed
    PutLe(&h, 0, 2);              // flags
    PutLe(&h, 0, 2);              // stored
    PutLe(&h, 0, 2);              // time
    PutLe(&h, 0x21, 2);           // date: 1980-01-01
    PutLe(&h, crc, 4);
    PutLe(&h, z64 ? 0xFFFFFFFF : data.size(), 4);
    PutLe(&h, z64 ? 0xFFFFFFFF : data.size(), 4);
    PutLe(&h, name.size(), 2);
    const uint64_t z64_len = z64 ? 20 : 0;
    const uint64_t before_pad = pos + 30 + name.size() + z64_len + 4;
    const uint64_t pad = (kAlign - before_pad % kAlign) % kAlign;
    PutLe(&h, z64_len + 4 + pad, 2);
    h += name;
    if (z64) {
      PutLe(&h, 1, 2);
      PutLe(&h, 16, 2);
      PutLe(&h, data.size(), 8);
      PutLe(&h, data.size(), 8);
    }
    PutLe(&h, 0x4246, 2);  // "FB": torch's padding to a 64-byte boundary
    PutLe(&h, pad, 2);
    h.append(pad, 'Z');
    // The central directory's entry.
    PutLe(&central, kCentralSig, 4);
    PutLe(&central, z64 ? 45 : 20, 2);
    PutLe(&central, z64 ? 45 : 20, 2);
    PutLe(&central, 0, 2);
    PutLe(&central, 0, 2);
    PutLe(&central, 0, 2);
    PutLe(&central, 0x21, 2);
    PutLe(&central, crc, 4);
    PutLe(&central, z64 ? 0xFFFFFFFF : data.size(), 4);
    PutLe(&central, z64 ? 0xFFFFFFFF : data.size(), 4);
    PutLe(&central, name.size(), 2);
    PutLe(&central, z64 ? 28 : 0, 2);
    PutLe(&central, 0, 2);  // comment
    PutLe(&central, 0, 2);  // disk
    PutLe(&central, 0, 2);  // internal attributes
    PutLe(&central, 0, 4);  // external attributes
    PutLe(&central, z64 ? 0xFFFFFFFF : pos, 4);
    central += name;
    if (z64) {
      PutLe(&central, 1, 2);
      PutLe(&central, 24, 2);
      PutLe(&central, data.size(), 8);
      PutLe(&central, data.size(), 8);
      PutLe(&central, pos, 8);
    }
    PTK_RETURN_IF_ERROR(w->Write(h));
    PTK_RETURN_IF_ERROR(w->Write(data.data(), data.size()));
    pos += h.size() + data.size();
  }
  const uint64_t cd_off = pos, cd_size = central.size(), n = files.size();
  const bool z64 = force_zip64 || cd_off >= 0xFFFFFFFFull;
  std::string tail = central;
  if (z64) {
    const uint64_t end64 = cd_off + cd_size;
    PutLe(&tail, kEnd64Sig, 4);
    PutLe(&tail, 44, 8);
    PutLe(&tail, 45, 2);
    PutLe(&tail, 45, 2);
    PutLe(&tail, 0, 4);
    PutLe(&tail, 0, 4);
    PutLe(&tail, n, 8);
    PutLe(&tail, n, 8);
    PutLe(&tail, cd_size, 8);
    PutLe(&tail, cd_off, 8);
    PutLe(&tail, kLocator64Sig, 4);
    PutLe(&tail, 0, 4);
    PutLe(&tail, end64, 8);
    PutLe(&tail, 1, 4);
  }
  PutLe(&tail, kEndSig, 4);
  PutLe(&tail, 0, 2);
  PutLe(&tail, 0, 2);
  PutLe(&tail, n, 2);
  PutLe(&tail, n, 2);
  PutLe(&tail, cd_size, 4);
  PutLe(&tail, z64 ? 0xFFFFFFFF : cd_off, 4);
  PutLe(&tail, 0, 2);
  PTK_RETURN_IF_ERROR(w->Write(tail));
  return w->Commit();
}

}  // namespace ptk::torchfmt
