// STUB libfmk_onnx_parser.so, FOR TESTS ONLY (see acl_stub.c): the graph-engine (GE) symbols the
// CANN execution provider uses to convert an ONNX graph to an offline model: CANN's
// graph/ascend_string.h, graph/graph.h, ge/ge_ir_build.h and parser/onnx_parser.h. In real CANN
// they live in libfmk_onnx_parser.so and the libraries it depends on (libgraph.so, libge_compiler.so).
// Parsing and building succeed and yield an empty model buffer.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>

namespace {
void trace(const char* name) {
  if (std::getenv("STUB_ACL_TRACE")) std::fprintf(stderr, "stub-ge: %s\n", name);
}
}  // namespace

namespace ge {
using graphStatus = uint32_t;
constexpr graphStatus GRAPH_SUCCESS = 0;

// Same layout as CANN's: the provider destroys these with the header's inline destructors.
class AscendString {
 public:
  AscendString(const char* name);
  bool operator<(const AscendString& other) const;

 private:
  std::shared_ptr<std::string> name_;
};

AscendString::AscendString(const char* name) : name_(std::make_shared<std::string>(name ? name : "")) {}
bool AscendString::operator<(const AscendString& other) const { return *name_ < *other.name_; }

class GraphImpl;
class Graph {
 public:
  explicit Graph(const char* name);

 private:
  std::shared_ptr<GraphImpl> impl_;
};
Graph::Graph(const char*) { trace("Graph"); }

struct ModelBufferData {
  std::shared_ptr<uint8_t> data;
  uint64_t length;
};

using Options = std::map<AscendString, AscendString>;

graphStatus aclgrphBuildInitialize(Options&) { trace("aclgrphBuildInitialize"); return GRAPH_SUCCESS; }
void aclgrphBuildFinalize() { trace("aclgrphBuildFinalize"); }
graphStatus aclgrphBuildModel(const Graph&, const Options&, ModelBufferData& model) {
  trace("aclgrphBuildModel");
  model.data = std::shared_ptr<uint8_t>(new uint8_t[1](), std::default_delete<uint8_t[]>());
  model.length = 1;
  return GRAPH_SUCCESS;
}
graphStatus aclgrphSaveModel(const char*, const ModelBufferData&) { trace("aclgrphSaveModel"); return GRAPH_SUCCESS; }
graphStatus aclgrphParseONNXFromMem(const char*, size_t, const Options&, Graph&) {
  trace("aclgrphParseONNXFromMem");
  return GRAPH_SUCCESS;
}
}  // namespace ge
