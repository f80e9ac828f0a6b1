/* STUB libascendcl.so, FOR TESTS ONLY: not Huawei's library and drives no device.
 *
 * Exports the pyACL C API symbols that onnxruntime-cann's libonnxruntime_providers_cann.so
 * links against (`nm -D --undefined-only` on the provider), so that ONNX Runtime can load the
 * CANN execution provider on a machine without CANN and we can observe what it does with
 * provider options, devices and failures. Signatures follow CANN's acl/acl_base.h,
 * acl/acl_rt.h, acl/acl_mdl.h and acl/acl_op.h.
 *
 * Behaviour, driven by environment variables:
 *   STUB_ACL_DEVICE_COUNT  devices aclrtGetDeviceCount reports (default 1)
 *   STUB_ACL_INIT_ERROR    aclInit returns this code instead of ACL_SUCCESS (e.g. 500000)
 *   STUB_ACL_TRACE         set: every call is written to stderr as "stub-acl: <name>"
 * aclInit and aclFinalize keep ACL's one initialisation per process as the older CANN's acl.cpp
 * does (pyACL acl.init, CANN 8.0.RC2: "一个进程内只能调用一次acl.init接口"), with its two flags: once
 * an aclInit succeeded, every later one answers ACL_ERROR_REPEAT_INITIALIZE; the first aclFinalize
 * ends ACL for every user in the process (it succeeds even if no aclInit did), a second answers
 * ACL_ERROR_REPEAT_FINALIZE; ACL is up between a successful aclInit and the aclFinalize.
 * stub_acl_initialized() (not CANN's API) tells tests/fake_acl/acl.py whether ACL is up, so the
 * FAKE pyACL can run on this library's ACL (its env FAKE_ACL_LIBRARY), as pyACL runs on the real one.
 * "Device" memory is host memory (aclrtMalloc is malloc) and copies are memcpy, so data moves;
 * nothing computes: an executed model or operator leaves its outputs untouched.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int aclError;
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_REPEAT_INITIALIZE 100002 /* acl_base.h */
#define ACL_ERROR_REPEAT_FINALIZE 100037
#define ACL_ERROR_RT_INVALID_DEVICEID 107001 /* rt_error_codes.h */

static void trace(const char *name) {
    if (getenv("STUB_ACL_TRACE")) fprintf(stderr, "stub-acl: %s\n", name);
}

static int env_int(const char *name, int fallback) {
    const char *value = getenv(name);
    return value && *value ? atoi(value) : fallback;
}

static char recent_error[128] = "";

static int init_flag, finalize_flag; /* acl.cpp's aclInitFlag and aclFinalizeFlag */

aclError aclInit(const char *config_path) {
    (void)config_path;
    trace("aclInit");
    int ret = init_flag ? ACL_ERROR_REPEAT_INITIALIZE : env_int("STUB_ACL_INIT_ERROR", ACL_SUCCESS);
    if (ret) {
        snprintf(recent_error, sizeof recent_error, "EE9999: stub aclInit failed with %d", ret);
        return ret;
    }
    init_flag = 1;
    return ACL_SUCCESS;
}
aclError aclFinalize(void) {
    trace("aclFinalize");
    if (finalize_flag) return ACL_ERROR_REPEAT_FINALIZE;
    finalize_flag = 1;
    return ACL_SUCCESS;
}
int stub_acl_initialized(void) { return init_flag && !finalize_flag; }
const char *aclGetRecentErrMsg(void) { trace("aclGetRecentErrMsg"); return recent_error; }

/* ---- devices, streams, events (acl_rt.h) ---- */
static int32_t current_device = -1;

aclError aclrtGetDeviceCount(uint32_t *count) {
    trace("aclrtGetDeviceCount");
    *count = (uint32_t)env_int("STUB_ACL_DEVICE_COUNT", 1);
    return ACL_SUCCESS;
}
aclError aclrtSetDevice(int32_t device_id) {
    trace("aclrtSetDevice");
    if (device_id < 0 || device_id >= env_int("STUB_ACL_DEVICE_COUNT", 1)) return ACL_ERROR_RT_INVALID_DEVICEID;
    current_device = device_id;
    return ACL_SUCCESS;
}
aclError aclrtGetDevice(int32_t *device_id) { trace("aclrtGetDevice"); *device_id = current_device; return ACL_SUCCESS; }
const char *aclrtGetSocName(void) { trace("aclrtGetSocName"); return "Ascend910B1"; }
aclError aclrtSynchronizeDevice(void) { trace("aclrtSynchronizeDevice"); return ACL_SUCCESS; }

static int handles; /* distinct non-null handles */
aclError aclrtCreateStream(void **stream) { trace("aclrtCreateStream"); *stream = &handles + 1; return ACL_SUCCESS; }
aclError aclrtDestroyStream(void *stream) { (void)stream; trace("aclrtDestroyStream"); return ACL_SUCCESS; }
aclError aclrtSynchronizeStream(void *stream) { (void)stream; trace("aclrtSynchronizeStream"); return ACL_SUCCESS; }
aclError aclrtCreateEvent(void **event) { trace("aclrtCreateEvent"); *event = &handles + 2; return ACL_SUCCESS; }
aclError aclrtDestroyEvent(void *event) { (void)event; trace("aclrtDestroyEvent"); return ACL_SUCCESS; }
aclError aclrtRecordEvent(void *event, void *stream) { (void)event; (void)stream; trace("aclrtRecordEvent"); return ACL_SUCCESS; }
aclError aclrtStreamWaitEvent(void *stream, void *event) { (void)stream; (void)event; trace("aclrtStreamWaitEvent"); return ACL_SUCCESS; }
aclError aclrtSynchronizeEvent(void *event) { (void)event; trace("aclrtSynchronizeEvent"); return ACL_SUCCESS; }

/* ---- memory ---- */
aclError aclrtMalloc(void **ptr, size_t size, int policy) {
    (void)policy;
    trace("aclrtMalloc");
    *ptr = malloc(size ? size : 1);
    return *ptr ? ACL_SUCCESS : 207001; /* ACL_ERROR_RT_MEMORY_ALLOCATION */
}
aclError aclrtFree(void *ptr) { trace("aclrtFree"); free(ptr); return ACL_SUCCESS; }
aclError aclrtMallocHost(void **ptr, size_t size) { trace("aclrtMallocHost"); *ptr = malloc(size ? size : 1); return ACL_SUCCESS; }
aclError aclrtFreeHost(void *ptr) { trace("aclrtFreeHost"); free(ptr); return ACL_SUCCESS; }
aclError aclrtMemcpy(void *dst, size_t dst_max, const void *src, size_t count, int kind) {
    (void)kind;
    trace("aclrtMemcpy");
    if (count > dst_max) return ACL_ERROR_INVALID_PARAM;
    memcpy(dst, src, count);
    return ACL_SUCCESS;
}
aclError aclrtMemcpyAsync(void *dst, size_t dst_max, const void *src, size_t count, int kind, void *stream) {
    (void)stream;
    return aclrtMemcpy(dst, dst_max, src, count, kind);
}
aclError aclrtMemsetAsync(void *ptr, size_t max, int32_t value, size_t count, void *stream) {
    (void)stream;
    trace("aclrtMemsetAsync");
    if (count > max) return ACL_ERROR_INVALID_PARAM;
    memset(ptr, value, count);
    return ACL_SUCCESS;
}

/* ---- buffers and tensor descriptions (acl_base.h) ---- */
typedef struct { void *data; size_t size; } aclDataBuffer;
aclDataBuffer *aclCreateDataBuffer(void *data, size_t size) {
    trace("aclCreateDataBuffer");
    aclDataBuffer *buffer = malloc(sizeof *buffer);
    buffer->data = data;
    buffer->size = size;
    return buffer;
}
aclError aclDestroyDataBuffer(const aclDataBuffer *buffer) { trace("aclDestroyDataBuffer"); free((void *)buffer); return ACL_SUCCESS; }

typedef struct { int type; } aclTensorDesc;
aclTensorDesc *aclCreateTensorDesc(int type, int num_dims, const int64_t *dims, int format) {
    (void)num_dims; (void)dims; (void)format;
    trace("aclCreateTensorDesc");
    aclTensorDesc *desc = malloc(sizeof *desc);
    desc->type = type;
    return desc;
}
void aclDestroyTensorDesc(const aclTensorDesc *desc) { trace("aclDestroyTensorDesc"); free((void *)desc); }
aclError aclSetTensorConst(aclTensorDesc *desc, void *data, size_t length) { (void)desc; (void)data; (void)length; trace("aclSetTensorConst"); return ACL_SUCCESS; }
size_t aclDataTypeSize(int type) {
    trace("aclDataTypeSize");
    /* acl_base.h aclDataType: FLOAT 0, FLOAT16 1, INT8 2, INT32 3, UINT8 4, INT16 6, UINT16 7,
       UINT32 8, INT64 9, UINT64 10, DOUBLE 11, BOOL 12 */
    static const size_t sizes[] = {4, 2, 1, 4, 1, 0, 2, 2, 4, 8, 8, 8, 1};
    return type >= 0 && type < (int)(sizeof sizes / sizeof *sizes) ? sizes[type] : 0;
}

/* ---- offline models (acl_mdl.h): a loaded model has no inputs or outputs and computes nothing ---- */
typedef struct { int unused; } aclmdlDesc;
typedef struct { int count; } aclmdlDataset;
aclmdlDesc *aclmdlCreateDesc(void) { trace("aclmdlCreateDesc"); return calloc(1, sizeof(aclmdlDesc)); }
aclError aclmdlDestroyDesc(aclmdlDesc *desc) { trace("aclmdlDestroyDesc"); free(desc); return ACL_SUCCESS; }
aclError aclmdlGetDesc(aclmdlDesc *desc, uint32_t model_id) { (void)desc; (void)model_id; trace("aclmdlGetDesc"); return ACL_SUCCESS; }
size_t aclmdlGetNumInputs(aclmdlDesc *desc) { (void)desc; trace("aclmdlGetNumInputs"); return 0; }
size_t aclmdlGetNumOutputs(aclmdlDesc *desc) { (void)desc; trace("aclmdlGetNumOutputs"); return 0; }
size_t aclmdlGetInputSizeByIndex(aclmdlDesc *desc, size_t index) { (void)desc; (void)index; trace("aclmdlGetInputSizeByIndex"); return 0; }
size_t aclmdlGetOutputSizeByIndex(aclmdlDesc *desc, size_t index) { (void)desc; (void)index; trace("aclmdlGetOutputSizeByIndex"); return 0; }
aclError aclmdlGetOutputDims(aclmdlDesc *desc, size_t index, void *dims) { (void)desc; (void)index; (void)dims; trace("aclmdlGetOutputDims"); return ACL_ERROR_INVALID_PARAM; }
aclmdlDataset *aclmdlCreateDataset(void) { trace("aclmdlCreateDataset"); return calloc(1, sizeof(aclmdlDataset)); }
aclError aclmdlDestroyDataset(const aclmdlDataset *dataset) { trace("aclmdlDestroyDataset"); free((void *)dataset); return ACL_SUCCESS; }
aclError aclmdlAddDatasetBuffer(aclmdlDataset *dataset, aclDataBuffer *buffer) { (void)buffer; trace("aclmdlAddDatasetBuffer"); dataset->count++; return ACL_SUCCESS; }
aclError aclmdlLoadFromFile(const char *path, uint32_t *model_id) { (void)path; trace("aclmdlLoadFromFile"); *model_id = 1; return ACL_SUCCESS; }
aclError aclmdlLoadFromMem(const void *model, size_t size, uint32_t *model_id) { (void)model; (void)size; trace("aclmdlLoadFromMem"); *model_id = 1; return ACL_SUCCESS; }
aclError aclmdlUnload(uint32_t model_id) { (void)model_id; trace("aclmdlUnload"); return ACL_SUCCESS; }
aclError aclmdlExecuteAsync(uint32_t model_id, const aclmdlDataset *in, aclmdlDataset *out, void *stream) {
    (void)model_id; (void)in; (void)out; (void)stream;
    trace("aclmdlExecuteAsync");
    return ACL_SUCCESS;
}

/* ---- operator attributes (acl_op.h) ---- */
typedef struct { int unused; } aclopAttr;
aclopAttr *aclopCreateAttr(void) { trace("aclopCreateAttr"); return calloc(1, sizeof(aclopAttr)); }
void aclopDestroyAttr(const aclopAttr *attr) { trace("aclopDestroyAttr"); free((void *)attr); }
aclError aclopSetAttrBool(aclopAttr *attr, const char *name, uint8_t value) { (void)attr; (void)name; (void)value; return ACL_SUCCESS; }
aclError aclopSetAttrInt(aclopAttr *attr, const char *name, int64_t value) { (void)attr; (void)name; (void)value; return ACL_SUCCESS; }
aclError aclopSetAttrFloat(aclopAttr *attr, const char *name, float value) { (void)attr; (void)name; (void)value; return ACL_SUCCESS; }
aclError aclopSetAttrString(aclopAttr *attr, const char *name, const char *value) { (void)attr; (void)name; (void)value; return ACL_SUCCESS; }
aclError aclopSetAttrListInt(aclopAttr *attr, const char *name, int count, const int64_t *values) { (void)attr; (void)name; (void)count; (void)values; return ACL_SUCCESS; }
