// Test helper for the Megatron compatibility test: writes a dataset from a JSON description with
// ptk's builder, or dumps a dataset read by ptk's reader as JSON.
//   dataset_tool write DTYPE_CODE PREFIX < docs.json     docs.json: [[[ids...], [ids...]], ...]
//   dataset_tool dump PREFIX > docs.json
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>

#include <simdjson.h>

#include "indexed_dataset/indexed_dataset.h"

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  std::string cmd = argv[1];
  if (cmd == "write" && argc == 4) {
    std::string json((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    simdjson::dom::parser p;
    simdjson::dom::element root = p.parse(json);
    auto dt = ptk::DTypeFromCode(static_cast<uint8_t>(std::atoi(argv[2])));
    if (!dt) return 2;
    auto b = ptk::IndexedDatasetBuilder::Create(argv[3], *dt);
    if (!b.ok()) return 1;
    for (auto doc : root.get_array()) {
      for (auto seq : doc.get_array()) {
        std::vector<int32_t> ids;
        for (auto x : seq.get_array()) ids.push_back(static_cast<int32_t>(int64_t(x)));
        if (!(*b)->AddItem(ids).ok()) return 1;
      }
      (*b)->EndDocument();
    }
    return (*b)->Finalize().ok() ? 0 : 1;
  }
  if (cmd == "dump") {
    auto ds = ptk::IndexedDataset::Open(argv[2]);
    if (!ds.ok()) {
      std::fprintf(stderr, "%s\n", std::string(ds.status().message()).c_str());
      return 1;
    }
    std::string out = "[";
    for (int64_t d = 0; d < (*ds)->num_documents(); ++d) {
      out += d ? ",[" : "[";
      for (int64_t s = (*ds)->document_index(d); s < (*ds)->document_index(d + 1); ++s) {
        out += s > (*ds)->document_index(d) ? ",[" : "[";
        auto span = (*ds)->sequence(s);
        for (int64_t i = 0; i < span.size; ++i) {
          if (i) out += ',';
          out += std::to_string(span[i]);
        }
        out += "]";
      }
      out += "]";
    }
    out += "]\n";
    std::fputs(out.c_str(), stdout);
    return 0;
  }
  return 2;
}
