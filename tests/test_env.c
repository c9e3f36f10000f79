/* test_env.c: the V41_* environment variables (ref/v41_env.h): values each kind accepts and
 * rejects, defaults when unset or empty, the exit status of a malformed value, the up-front check's
 * errors and warnings, and that every variable the sources read is in the table. */
#include "config.h"
#include "v41_env.h"
#include <check.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int ok(const char *name, const char *value, long *x)
{
    const v41_env_var *v = v41_env_find(name, strlen(name));
    ck_assert_msg(v != NULL, "%s not in the table", name);
    return v41_env_parse(v, value, x);
}

START_TEST(test_parse_kinds)
{
    long x = -1;
    /* a switch: exactly 0 or 1 */
    ck_assert(ok("V41_WQ_NO_GEMV", "1", &x) && x == 1);
    ck_assert(ok("V41_WQ_NO_GEMV", "0", &x) && x == 0);
    const char *bad_flag[] = {"yes", "2", "-1", "1 ", " 1", "+1", "01x", "true", "0x1"};
    for (size_t i = 0; i < sizeof bad_flag / sizeof bad_flag[0]; i++)
        ck_assert_msg(!ok("V41_WQ_NO_GEMV", bad_flag[i], &x), "switch accepted '%s'", bad_flag[i]);
    /* a range */
    ck_assert(ok("V41_WQ_SPLITS", "1", &x) && x == 1);
    ck_assert(ok("V41_WQ_SPLITS", "4096", &x) && x == 4096);
    ck_assert(!ok("V41_WQ_SPLITS", "0", &x));
    ck_assert(!ok("V41_WQ_SPLITS", "4097", &x));
    ck_assert(!ok("V41_WQ_SPLITS", "3.5", &x));
    ck_assert(!ok("V41_WQ_SPLITS", "99999999999999999999999", &x));   /* strtol saturates past hi */
    ck_assert(ok("V41_ATTN_DEPTH", "2", &x) && x == 2);
    ck_assert(!ok("V41_ATTN_DEPTH", "3", &x));
    /* a choice list: in the range is not enough */
    ck_assert(ok("V41_WQ_TAIL", "0", &x) && x == 0);
    ck_assert(ok("V41_WQ_TAIL", "8", &x) && x == 8);
    ck_assert(ok("V41_WQ_TAIL", "16", &x) && x == 16);
    ck_assert(!ok("V41_WQ_TAIL", "12", &x));
    ck_assert(!ok("V41_WQ_TAIL", "1", &x));
    ck_assert(!ok("V41_WQ_TAIL", "6", &x));   /* a digit of "16" */
    /* text is not checked */
    ck_assert(ok("V41_INJECT", "anything at all", &x));
}
END_TEST

START_TEST(test_defaults)
{
    unsetenv("V41_WQ_TAIL");
    ck_assert_int_eq(v41_env_long("V41_WQ_TAIL", 16), 16);
    setenv("V41_WQ_TAIL", "", 1);   /* empty: as unset */
    ck_assert_int_eq(v41_env_long("V41_WQ_TAIL", 16), 16);
    setenv("V41_WQ_TAIL", "8", 1);
    ck_assert_int_eq(v41_env_long("V41_WQ_TAIL", 16), 8);
    unsetenv("V41_WQ_TAIL");
    unsetenv("V41_GPU_GRAPH");
    ck_assert_int_eq(v41_env_flag("V41_GPU_GRAPH", 1), 1);   /* default on */
    setenv("V41_GPU_GRAPH", "0", 1);
    ck_assert_int_eq(v41_env_flag("V41_GPU_GRAPH", 1), 0);
    unsetenv("V41_GPU_GRAPH");
}
END_TEST

/* a malformed value read where it is used exits with status 2 (exit tests, in a child) */
START_TEST(test_bad_value_exits)
{
    setenv("V41_WQ_TAIL", "12", 1);
    v41_env_long("V41_WQ_TAIL", 16);
}
END_TEST
START_TEST(test_bad_flag_exits)
{
    setenv("V41_WQ_NO_GEMV", "no", 1);
    v41_env_flag("V41_WQ_NO_GEMV", 0);
}
END_TEST
START_TEST(test_unlisted_read_exits)
{
    v41_env_long("V41_NOT_A_VARIABLE", 0);   /* a reader of a name the table lacks: a programming error */
}
END_TEST

/* the up-front check: errors for malformed values, warnings for unknown V41_* names, other names ignored */
START_TEST(test_check_list)
{
    char buf[4096] = {0};
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    ck_assert_ptr_nonnull(f);
    char *env[] = {"PATH=/bin", "V41_WQ_TAIL=12", "V41_WQ_NOGEMV=1", "V41_GPU_VERBOSE=", "V41_WQ_SPLITS=3",
                   "V41_INJECT=x", "V41_ATTN_DEPTH=9", "V41X=1", NULL};
    const int bad = v41_env_check_list(env, f);
    fclose(f);
    ck_assert_int_eq(bad, 2);   /* V41_WQ_TAIL and V41_ATTN_DEPTH */
    ck_assert_ptr_nonnull(strstr(buf, "V41_WQ_TAIL='12': expected one of 0|8|16"));
    ck_assert_ptr_nonnull(strstr(buf, "V41_ATTN_DEPTH='9': expected a whole number in [1, 2]"));
    ck_assert_ptr_nonnull(strstr(buf, "warning: environment variable V41_WQ_NOGEMV is not one v41 reads"));
    ck_assert_ptr_null(strstr(buf, "V41_WQ_SPLITS"));
    ck_assert_ptr_null(strstr(buf, "V41_GPU_VERBOSE"));
    ck_assert_ptr_null(strstr(buf, "V41X"));
    ck_assert_ptr_null(strstr(buf, "PATH"));
}
END_TEST

/* every "V41_..." name that a source file passes to getenv, v41_env_long, v41_env_flag or
 * g_env_flag is in the table (a reader of an unlisted name would exit 2 at its first call) */
static int scan_file(const char *path, char *missing, size_t cap)
{
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    static char text[1 << 21];
    const size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    static const char *readers[] = {"getenv(\"", "v41_env_long(\"", "v41_env_flag(\"", "g_env_flag(\""};
    int found = 0;
    for (size_t r = 0; r < sizeof readers / sizeof readers[0]; r++)
        for (const char *p = text; (p = strstr(p, readers[r])); p++) {
            const char *name = p + strlen(readers[r]), *end = strchr(name, '"');
            if (strncmp(name, "V41_", 4) || !end) continue;
            found++;
            if (!v41_env_find(name, (size_t)(end - name))) {
                /* (a listing of what is missing: a long one may be cut, the failure stands) */
                const size_t used = strlen(missing), len = (size_t)(end - name);
                if (cap - used > 1)
                    snprintf(missing + used, cap - used, "%.300s: %.*s\n", path, (int)(len < 127 ? len : 127), name);
            }
        }
    return found;
}

START_TEST(test_table_covers_sources)
{
    const char *dirs[] = {"ref", "gpu", "harness", "sim", "gpu/bench"};
    char missing[4096] = {0};
    int found = 0;
    for (size_t d = 0; d < sizeof dirs / sizeof dirs[0]; d++) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/%s", V41_TESTDATA, dirs[d]);
        DIR *D = opendir(dir);
        ck_assert_msg(D != NULL, "cannot open %s", dir);
        for (struct dirent *e; (e = readdir(D));) {
            const char *dot = strrchr(e->d_name, '.');
            if (!dot || (strcmp(dot, ".c") && strcmp(dot, ".cu") && strcmp(dot, ".cuh") && strcmp(dot, ".h"))) continue;
            char path[8192];
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            found += scan_file(path, missing, sizeof missing);
        }
        closedir(D);
    }
    ck_assert_msg(!missing[0], "variables read but not in ref/v41_env.h:\n%s", missing);
    ck_assert_int_ge(found, 15);   /* the scan sees the readers (about 20 calls today) */
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("env");
    TCase *t = tcase_create("env");
    tcase_add_test(t, test_parse_kinds);
    tcase_add_test(t, test_defaults);
    tcase_add_exit_test(t, test_bad_value_exits, 2);
    tcase_add_exit_test(t, test_bad_flag_exits, 2);
    tcase_add_exit_test(t, test_unlisted_read_exits, 2);
    tcase_add_test(t, test_check_list);
    tcase_add_test(t, test_table_covers_sources);
    suite_add_tcase(s, t);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_NORMAL);
    const int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
