/* STUB libacl_op_compiler.so, FOR TESTS ONLY (see acl_stub.c): CANN's acl/ops/acl_op_compiler.h.
 * The operator is "compiled and executed" without computing anything: outputs stay as they were. */
#include <stdio.h>
#include <stdlib.h>

int aclopCompileAndExecute(const char *op_type, int num_inputs, const void *const input_desc[],
                           const void *const inputs[], int num_outputs, const void *const output_desc[],
                           void *const outputs[], const void *attr, int engine_type, int compile_flag,
                           const char *op_path, void *stream) {
    (void)num_inputs; (void)input_desc; (void)inputs; (void)num_outputs; (void)output_desc;
    (void)outputs; (void)attr; (void)engine_type; (void)compile_flag; (void)op_path; (void)stream;
    if (getenv("STUB_ACL_TRACE")) fprintf(stderr, "stub-acl: aclopCompileAndExecute %s\n", op_type);
    return 0;
}
