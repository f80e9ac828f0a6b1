// STUB libfmk_onnx_parser.so, FOR TESTS ONLY (see acl_stub.c): the graph-engine (GE) symbols the
// CANN execution provider uses to convert an ONNX graph to an offline model: CANN's
// graph/ascend_string.h, graph/graph.h, ge/ge_ir_build.h and parser/onnx_parser.h. In real CANN
// they live in libfmk_onnx_parser.so and the libraries it depends on (libgraph.so, libge_compiler.so).
// Parsing and building succeed and yield a model buffer of a few bytes, which aclgrphSaveModel
// writes to a file as CANN does (below).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
constexpr graphStatus GRAPH_PARAM_INVALID = 50331649;  // graph/ge_error_codes.h
constexpr graphStatus FAILED = 0xFFFFFFFFu;           // ge_api_error_codes.h: GE_ERRORNO(0b11, 0b11, 0b111, 0xFF, 0b11111, FAILED, 0xFFF)

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
  static const char kModel[] = "STUB OM: tests/cann_stubs, not a model\n";
  model.data = std::shared_ptr<uint8_t>(new uint8_t[sizeof kModel - 1], std::default_delete<uint8_t[]>());
  std::memcpy(model.data.get(), kModel, sizeof kModel - 1);
  model.length = sizeof kModel - 1;
  return GRAPH_SUCCESS;
}

// Saves as CANN's graph engine does: aclgrphSaveModel writes "<output_file>.om" through
// FileSaver::SaveToFile (ge/ir_build/ge_ir_build.cc in mindspore-ai/graphengine; an empty model is
// GRAPH_PARAM_INVALID). FileSaver (ge/common/auth/file_saver.cc): CheckPath refuses a path of
// MMPA_MAX_PATH (4096) or more and creates the directories before the file name, each mode 0700
// (CreateDirectory, ge/common/util.cc); OpenFile opens it O_RDWR | O_CREAT | O_TRUNC, mode 0600;
// any failure is logged and returned as FAILED. The file name is relative to the working directory
// when it has no directory: the CANN execution provider passes "<subgraph>_<shape hash>".
static graphStatus save(const std::string& path, const ModelBufferData& model) {
  if (path.size() >= 4096) return FAILED;
  for (size_t slash = path.find('/', 1); slash != std::string::npos; slash = path.find('/', slash + 1)) {
    const std::string directory = path.substr(0, slash);
    if (access(directory.c_str(), F_OK) != 0 && mkdir(directory.c_str(), S_IRUSR | S_IWUSR | S_IXUSR) != 0) {
      std::fprintf(stderr, "stub-ge: aclgrphSaveModel: cannot create %s: %s\n", directory.c_str(), std::strerror(errno));
      return FAILED;
    }
  }
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, S_IRUSR | S_IWUSR);
  if (fd < 0) {
    std::fprintf(stderr, "stub-ge: aclgrphSaveModel: cannot open %s: %s\n", path.c_str(), std::strerror(errno));
    return FAILED;
  }
  const bool written = write(fd, model.data.get(), model.length) == static_cast<ssize_t>(model.length);
  if (!written) std::fprintf(stderr, "stub-ge: aclgrphSaveModel: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
  return close(fd) == 0 && written ? GRAPH_SUCCESS : FAILED;
}

graphStatus aclgrphSaveModel(const char* output_file, const ModelBufferData& model) {
  trace("aclgrphSaveModel");
  if (!model.data || model.length == 0) return GRAPH_PARAM_INVALID;
  return save(std::string(output_file ? output_file : "") + ".om", model);
}
graphStatus aclgrphParseONNXFromMem(const char*, size_t, const Options&, Graph&) {
  trace("aclgrphParseONNXFromMem");
  return GRAPH_SUCCESS;
}
}  // namespace ge
