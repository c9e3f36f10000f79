/* common.c: error helpers and dtype names. */
#include "v41_common.h"
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int v41_err_set(v41_err *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

int v41_err_prefix(v41_err *err, const char *fmt, ...)
{
    if (!err) return V41_EINTERNAL;
    char pre[512], old[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    /* a message longer than the buffer is cut there (intended: with the result checked, for an
     * output error, the compiler does not warn about the truncation) */
    if (snprintf(err->msg, sizeof err->msg, "%s: %s", pre, old) < 0) memcpy(err->msg, old, sizeof old);
    return err->code;
}

static const struct { v41_dtype dt; const char *name; int bits; } dtypes[] = {
    {V41_DT_BF16, "BF16", 16}, {V41_DT_F16, "F16", 16}, {V41_DT_F32, "F32", 32},
    {V41_DT_F64, "F64", 64}, {V41_DT_I8, "I8", 8}, {V41_DT_U8, "U8", 8},
    {V41_DT_BOOL, "BOOL", 8}, {V41_DT_I16, "I16", 16}, {V41_DT_I32, "I32", 32},
    {V41_DT_I64, "I64", 64}, {V41_DT_F8_E4M3, "F8_E4M3", 8}, {V41_DT_F8_E8M0, "F8_E8M0", 8},
    {V41_DT_F4, "F4", 4},
};

v41_dtype v41_dtype_from_name(const char *name)
{
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
        if (!strcmp(dtypes[i].name, name)) return dtypes[i].dt;
    return V41_DT_INVALID;
}

const char *v41_dtype_name(v41_dtype dt)
{
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
        if (dtypes[i].dt == dt) return dtypes[i].name;
    return "INVALID";
}

size_t v41_dtype_nbytes(v41_dtype dt, int64_t n)
{
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
        if (dtypes[i].dt == dt) return (size_t)((n * dtypes[i].bits + 7) / 8);
    return 0;
}
