/* v41_common.h: error reporting and dtypes shared by every module.
 *
 * Errors are returned as codes; the v41_err carries a message that names
 * the file, tensor or key at fault. Exit status convention of the CLI:
 * 0 ok, 1 "different" (diff/oracle-check), 2 bad input or error. */
#ifndef V41_COMMON_H
#define V41_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    V41_OK = 0,
    V41_EINVAL = 2,   /* malformed input: config, checkpoint, dump, trace */
    V41_EIO = 3,      /* cannot open / read / write / mmap */
    V41_ENOMEM = 4,
    V41_ENOTFOUND = 5,/* missing tensor, dataset, key */
    V41_EUNSUPPORTED = 6,
    V41_EINTERNAL = 7,
};

typedef struct v41_err {
    int code;
    char msg[1024];
} v41_err;

/* Sets err (if non-NULL) and returns code. printf-style. */
int v41_err_set(v41_err *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Prepends "ctx: " to an existing message. Returns err->code. */
int v41_err_prefix(v41_err *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

typedef enum v41_dtype {
    V41_DT_INVALID = 0,
    V41_DT_BF16,
    V41_DT_F16,
    V41_DT_F32,
    V41_DT_F64,
    V41_DT_I8,
    V41_DT_U8,
    V41_DT_BOOL,
    V41_DT_I16,
    V41_DT_I32,
    V41_DT_I64,
    V41_DT_F8_E4M3,
    V41_DT_F8_E8M0,
    V41_DT_F4,        /* e2m1, two per byte, element 2j in the low nibble */
} v41_dtype;

/* safetensors dtype string <-> enum ("BF16", "F8_E4M3", "F4", ...). */
v41_dtype v41_dtype_from_name(const char *name);
const char *v41_dtype_name(v41_dtype dt);
/* Bytes for n elements (F4: n/2, n must be even). Returns 0 for INVALID. */
size_t v41_dtype_nbytes(v41_dtype dt, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
