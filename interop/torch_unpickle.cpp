// PyTorch's pickles read without executing anything: a tree of values, globals kept as names.
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include <fmt/core.h>

#include "common/status.h"
#include "interop/torch_format.h"

namespace ptk::torchfmt {

namespace {
PyRef Make(PyValue::Kind k) {
  auto v = std::make_shared<PyValue>();
  v->kind = k;
  return v;
}
}  // namespace

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
      "builtins.getattr",  // only as getattr(<one of these globals>, name): Python 3.11's pickle of an enum member
      "__builtin__.getattr",
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
    if (f == "builtins.getattr" || f == "__builtin__.getattr") {  // an enum member by name, e.g. a
      // TensorProperties' memory format getattr(_MEM_FORMAT_ENCODING, 'TORCH_CONTIGUOUS_FORMAT'): the name it makes
      if (args.size() != 2 || args[0]->kind != PyValue::Kind::kGlobal || args[1]->kind != PyValue::Kind::kStr)
        return Bad(f + " of something other than (a global, a name): refusing the file");
      return MakeGlobal(args[0]->s + "." + args[1]->s);
    }
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
    const bool known =
        type.rfind("torch.", 0) == 0 && DTypeOfStorageType(std::string_view(type).substr(6), &v->tensor.dtype);
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

}  // namespace ptk::torchfmt
