/* tap.c: the tap table (ref/v41_taps.def) and name matching. */
#include "v41_tap.h"
#include <ctype.h>
#include <stdio.h>
#include <string.h>

static const v41_tap_desc table[] = {
#define V41_TAP(pattern, dims, kind, discrete, golden, meaning) {pattern, dims, kind, meaning, golden, discrete},
#include "v41_taps.def"
#undef V41_TAP
};

const v41_tap_desc *v41_tap_table(size_t *n)
{
    if (n) *n = sizeof table / sizeof table[0];
    return table;
}

/* glob over [p, pe) against s: '*' any run, '?' one char */
static bool glob(const char *p, const char *pe, const char *s)
{
    const char *star = NULL, *ss = NULL;
    while (*s) {
        if (p < pe && (*p == '?' || *p == *s)) { p++; s++; }
        else if (p < pe && *p == '*') { star = p++; ss = s; }
        else if (star) { p = star + 1; s = ++ss; }
        else return false;
    }
    while (p < pe && *p == '*') p++;
    return p == pe;
}

bool v41_tap_match(const char *pattern, const char *name)
{
    if (!pattern) return true;
    if (!name) return false;
    const char *p = pattern;
    for (;;) {
        const char *e = strchr(p, ',');
        const char *pe = e ? e : p + strlen(p);
        while (p < pe && *p == ' ') p++;
        if (p < pe && glob(p, pe, name)) return true;
        if (!e) return false;
        p = e + 1;
    }
}

/* pattern "layer.{l}.x" matches "layer.12.x"; stage taps "dspark.{s}.x" use the layer
 * descriptors ("dspark.0.attn.q" -> "layer.{l}.attn.q"). */
static bool pat_eq(const char *pat, const char *name)
{
    while (*pat && *name) {
        if (pat[0] == '{') {
            const char *cl = strchr(pat, '}');
            if (!cl || !isdigit((unsigned char)*name)) return false;
            while (isdigit((unsigned char)*name)) name++;
            pat = cl + 1;
            continue;
        }
        if (*pat != *name) return false;
        pat++;
        name++;
    }
    return !*pat && !*name;
}

const v41_tap_desc *v41_tap_lookup(const char *name)
{
    if (!name) return NULL;
    char buf[256];
    if (!strncmp(name, "dspark.", 7) && isdigit((unsigned char)name[7])) {
        snprintf(buf, sizeof buf, "layer.%s", name + 7);
        name = buf;
    }
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (pat_eq(table[i].pattern, name)) return &table[i];
    return NULL;
}
