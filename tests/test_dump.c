/* test_dump: the v41 dump writer/reader (harness/dump.c).
 * Values are written and read back bit-exactly; flat-range reads through
 * hyperslab unions are checked against the flat array for every (offset,
 * length) on odd shapes; schema validation and temp-file handling. */
#include "v41_dump.h"
#include <check.h>
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char tmpdir[512];

static void mkpath(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", tmpdir, name);
}

static void setup(void)
{
    const char *b = getenv("V41_BUILDDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/tests/tmp_dump_%d", b ? b : ".", (int)getpid());
    char cmd[600];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", tmpdir);
    ck_assert_int_eq(system(cmd), 0);
}

static void teardown(void)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    (void)!system(cmd);
}

static v41_dump *new_dump(const char *path)
{
    v41_dump_meta m = {.engine = "ref", .precision = "emulate", .config_json = "{\"n_layers\":2}", .threads = 3};
    v41_dump *d = NULL;
    v41_err err = {0};
    ck_assert_msg(v41_dump_create(path, &m, &d, &err) == 0, "%s", err.msg);
    return d;
}

START_TEST(test_roundtrip_kinds)
{
    char path[600];
    mkpath(path, sizeof path, "rt.h5");
    v41_dump *d = new_dump(path);
    v41_err err = {0};
    /* file appears only at close (temp name + rename) */
    ck_assert_int_ne(access(path, F_OK), 0);
    float f[3 * 5 * 7];
    for (int i = 0; i < 105; i++) f[i] = (float)i * 0.5f - 20.0f;
    int32_t ix[4 * 3] = {0, 1, -1, 3, 4, 5, 6, -1, -1, 9, 10, 11};
    uint8_t m8[2 * 6] = {1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1};
    float scalar = 3.25f;
    /* deliberately emitted with descending names: the reader must order by 'order' */
    v41_tap t1 = {.name = "z.first", .step = 0, .layer = -1, .kind = V41_TAP_F32, .ndim = 3, .shape = {3, 5, 7}, .data = f, .order = 0};
    v41_tap t2 = {.name = "layer.1.attn.topk", .step = 0, .layer = 1, .kind = V41_TAP_I32, .ndim = 2, .shape = {4, 3}, .data = ix, .order = 1};
    v41_tap t3 = {.name = "a.mask", .step = 0, .layer = -1, .kind = V41_TAP_U8, .ndim = 2, .shape = {2, 6}, .data = m8, .order = 2};
    v41_tap t4 = {.name = "s", .step = 2, .layer = -1, .kind = V41_TAP_BF16, .ndim = 0, .data = &scalar, .order = 0};
    v41_tap t5 = {.name = "empty", .step = 2, .layer = -1, .kind = V41_TAP_F32, .ndim = 2, .shape = {0, 4}, .data = NULL, .order = 1};
    ck_assert_msg(v41_dump_write_tap(d, &t1, &err) == 0, "%s", err.msg);
    ck_assert_msg(v41_dump_write_tap(d, &t2, &err) == 0, "%s", err.msg);
    ck_assert_msg(v41_dump_write_tap(d, &t3, &err) == 0, "%s", err.msg);
    ck_assert_msg(v41_dump_write_tap(d, &t4, &err) == 0, "%s", err.msg);
    ck_assert_msg(v41_dump_write_tap(d, &t5, &err) == 0, "%s", err.msg);
    /* append along dim 0 */
    ck_assert_msg(v41_dump_write_tap(d, &t2, &err) == 0, "%s", err.msg);
    /* bad names rejected */
    v41_tap bad = t1;
    bad.name = "a/b";
    ck_assert_int_eq(v41_dump_write_tap(d, &bad, &err), V41_EINVAL);
    bad.name = "rows";
    ck_assert_int_eq(v41_dump_write_tap(d, &bad, &err), V41_EINVAL);
    int32_t req[3] = {7, 7, 8}, pos[3] = {0, 1, 0};
    ck_assert_int_eq(v41_dump_set_rows(d, 0, 3, req, pos, &err), 0);
    int32_t ids[2] = {7, 8}, pl[2] = {2, 1};
    ck_assert_int_eq(v41_dump_set_requests(d, 2, ids, pl, NULL, &err), 0);
    ck_assert_int_eq(v41_dump_n_taps(d), 5);
    ck_assert_msg(v41_dump_close(d, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(access(path, F_OK), 0);
    char tmp[700];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    ck_assert_int_ne(access(tmp, F_OK), 0);

    v41_dump_reader *r;
    ck_assert_msg(v41_dump_open(path, &r, &err) == 0, "%s", err.msg);
    ck_assert_str_eq(v41_dump_attr(r, "schema"), "v41-dump");
    ck_assert_str_eq(v41_dump_attr(r, "version"), "1");
    ck_assert_str_eq(v41_dump_attr(r, "engine"), "ref");
    ck_assert_str_eq(v41_dump_attr(r, "threads"), "3");
    ck_assert_int_eq(v41_dump_count(r), 5);
    ck_assert_int_eq(v41_dump_n_steps(r), 2);
    ck_assert_int_eq(v41_dump_step_at(r, 1), 2);
    const v41_dump_entry *e0 = v41_dump_at(r, 0), *e1 = v41_dump_at(r, 1), *e2 = v41_dump_at(r, 2);
    ck_assert_str_eq(e0->name, "z.first");
    ck_assert_str_eq(e1->name, "layer.1.attn.topk");
    ck_assert_str_eq(e2->name, "a.mask");
    ck_assert_int_eq(e1->layer, 1);
    ck_assert(e1->discrete && !e0->discrete && e2->discrete);
    ck_assert_int_eq(e1->shape[0], 8);   /* appended */
    ck_assert_int_eq(e0->kind, V41_TAP_F32);
    ck_assert(e0->has_stats);
    /* rms of 0.5*i - 20: computed here from the definition */
    double ss = 0;
    for (int i = 0; i < 105; i++) ss += (double)f[i] * f[i];
    ck_assert_double_eq_tol(e0->rms, sqrt(ss / 105), 1e-12);
    float back[105];
    ck_assert_int_eq(v41_dump_read(r, e0, 0, 105, back, &err), 0);
    ck_assert_int_eq(memcmp(back, f, sizeof f), 0);
    int32_t ib[24];
    ck_assert_int_eq(v41_dump_read(r, e1, 0, 24, ib, &err), 0);
    ck_assert_int_eq(memcmp(ib, ix, sizeof ix), 0);
    ck_assert_int_eq(memcmp(ib + 12, ix, sizeof ix), 0);
    uint8_t mb[12];
    ck_assert_int_eq(v41_dump_read(r, e2, 0, 12, mb, &err), 0);
    ck_assert_int_eq(memcmp(mb, m8, 12), 0);
    const v41_dump_entry *es = v41_dump_find(r, 2, "s");
    ck_assert_ptr_nonnull(es);
    ck_assert_int_eq(es->kind, V41_TAP_BF16);
    ck_assert_int_eq(es->ndim, 0);
    float sv = 0;
    ck_assert_int_eq(v41_dump_read(r, es, 0, 1, &sv, &err), 0);
    ck_assert(sv == 3.25f);
    ck_assert_ptr_nonnull(v41_dump_find(r, 2, "empty"));
    ck_assert_ptr_null(v41_dump_find(r, 1, "s"));
    /* out-of-range read rejected */
    ck_assert_int_eq(v41_dump_read(r, e0, 100, 10, back, &err), V41_EINVAL);
    int n;
    int32_t *rq, *ps;
    ck_assert_int_eq(v41_dump_read_rows(r, 0, &n, &rq, &ps, &err), 0);
    ck_assert_int_eq(n, 3);
    ck_assert_int_eq(rq[2], 8);
    ck_assert_int_eq(ps[1], 1);
    free(rq);
    free(ps);
    ck_assert_int_eq(v41_dump_read_rows(r, 2, &n, &rq, &ps, &err), 0);
    ck_assert_int_eq(n, 0);
    v41_dump_reader_close(r);
}
END_TEST

/* every flat range [off, off+len) of a 4-D tensor reads the right elements */
START_TEST(test_flat_ranges)
{
    char path[600];
    mkpath(path, sizeof path, "ranges.h5");
    v41_dump *d = new_dump(path);
    v41_err err = {0};
    enum { A = 3, B = 4, C = 2, D = 5, N = A * B * C * D };
    float f[N];
    for (int i = 0; i < N; i++) f[i] = (float)i;
    v41_tap t = {.name = "x", .step = 1, .kind = V41_TAP_F32, .ndim = 4, .shape = {A, B, C, D}, .data = f};
    ck_assert_int_eq(v41_dump_write_tap(d, &t, &err), 0);
    ck_assert_int_eq(v41_dump_close(d, &err), 0);
    v41_dump_reader *r;
    ck_assert_int_eq(v41_dump_open(path, &r, &err), 0);
    const v41_dump_entry *e = v41_dump_find(r, 1, "x");
    ck_assert_ptr_nonnull(e);
    float buf[N];
    for (int off = 0; off < N; off++)
        for (int len = 1; off + len <= N; len += (len < 12 ? 1 : 7)) {
            memset(buf, 0xff, sizeof buf);
            ck_assert_int_eq(v41_dump_read(r, e, off, len, buf, &err), 0);
            for (int i = 0; i < len; i++)
                ck_assert_msg(buf[i] == (float)(off + i), "off %d len %d i %d got %g", off, len, i, buf[i]);
        }
    v41_dump_reader_close(r);
}
END_TEST

START_TEST(test_not_a_dump)
{
    v41_err err = {0};
    v41_dump_reader *r = NULL;
    char path[600];
    mkpath(path, sizeof path, "missing.h5");
    ck_assert_int_eq(v41_dump_open(path, &r, &err), V41_EIO);
    ck_assert_ptr_nonnull(strstr(err.msg, "missing.h5"));
    /* plain HDF5 file without the schema attribute */
    mkpath(path, sizeof path, "plain.h5");
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    H5Fclose(f);
    ck_assert_int_eq(v41_dump_open(path, &r, &err), V41_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "not a v41 dump"));
    /* right schema, wrong version */
    mkpath(path, sizeof path, "v2.h5");
    v41_dump *d = new_dump(path);
    ck_assert_int_eq(v41_dump_close(d, &err), 0);
    f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    int32_t two = 2;
    hid_t a = H5Aopen(f, "version", H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT32, &two);
    H5Aclose(a);
    H5Fclose(f);
    ck_assert_int_eq(v41_dump_open(path, &r, &err), V41_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "version 2"));
    /* not HDF5 at all */
    mkpath(path, sizeof path, "text.h5");
    FILE *t = fopen(path, "w");
    fputs("hello\n", t);
    fclose(t);
    ck_assert_int_eq(v41_dump_open(path, &r, &err), V41_EINVAL);
}
END_TEST

START_TEST(test_abort_and_sink)
{
    char path[600], tmp[700];
    mkpath(path, sizeof path, "ab.h5");
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    v41_dump *d = new_dump(path);
    ck_assert_int_eq(access(tmp, F_OK), 0);
    v41_dump_abort(d);
    ck_assert_int_ne(access(tmp, F_OK), 0);
    ck_assert_int_ne(access(path, F_OK), 0);

    /* sink with a pattern: only matching taps land in the file */
    d = new_dump(path);
    v41_tap_sink s;
    v41_dump_sink(d, &s, "layer.*.attn.*,logits");
    float v[4] = {1, 2, 3, 4};
    const char *names[] = {"embed", "layer.0.attn.q", "layer.0.ffn.out", "logits"};
    for (int i = 0; i < 4; i++) {
        v41_tap t = {.name = names[i], .step = 0, .kind = V41_TAP_F32, .ndim = 1, .shape = {4}, .data = v, .order = i};
        ck_assert_int_eq(s.emit(s.ctx, &t), 0);
    }
    /* an invalid tap makes the sink fail and close() report it (and leave no file) */
    v41_tap badt = {.name = "bad/name", .step = 0, .kind = V41_TAP_F32, .ndim = 1, .shape = {4}, .data = v};
    s.pattern = NULL;
    v41_dump_sink(d, &s, NULL);
    ck_assert_int_ne(s.emit(s.ctx, &badt), 0);
    v41_err err = {0};
    ck_assert_int_ne(v41_dump_close(d, &err), 0);
    ck_assert_int_ne(access(path, F_OK), 0);
    ck_assert_int_ne(access(tmp, F_OK), 0);

    d = new_dump(path);
    v41_dump_sink(d, &s, "layer.*.attn.*,logits");
    for (int i = 0; i < 4; i++) {
        v41_tap t = {.name = names[i], .step = 0, .kind = V41_TAP_F32, .ndim = 1, .shape = {4}, .data = v, .order = i};
        ck_assert_int_eq(s.emit(s.ctx, &t), 0);
    }
    ck_assert_int_eq(v41_dump_close(d, &err), 0);
    v41_dump_reader *r;
    ck_assert_int_eq(v41_dump_open(path, &r, &err), 0);
    ck_assert_int_eq(v41_dump_count(r), 2);
    ck_assert_str_eq(v41_dump_at(r, 0)->name, "layer.0.attn.q");
    ck_assert_str_eq(v41_dump_at(r, 1)->name, "logits");

    /* tap source: hit, absent, shape mismatch */
    v41_tap_source src;
    v41_dump_source *ds;
    ck_assert_int_eq(v41_dump_source_create(r, NULL, &ds, &src, &err), 0);
    float got[4] = {0};
    int64_t sh4[1] = {4}, sh5[1] = {5};
    ck_assert_int_eq(src.fetch(src.ctx, "logits", 0, V41_TAP_F32, 1, sh4, got), 1);
    ck_assert(got[3] == 4.0f);
    ck_assert_int_eq(src.fetch(src.ctx, "logits", 1, V41_TAP_F32, 1, sh4, got), 0);
    ck_assert_int_eq(src.fetch(src.ctx, "embed", 0, V41_TAP_F32, 1, sh4, got), 0);
    ck_assert_int_lt(src.fetch(src.ctx, "logits", 0, V41_TAP_F32, 1, sh5, got), 0);
    ck_assert_ptr_nonnull(strstr(v41_dump_source_error(ds)->msg, "shape"));
    ck_assert_int_lt(src.fetch(src.ctx, "logits", 0, V41_TAP_I32, 1, sh4, got), 0);
    ck_assert_int_eq(v41_dump_source_hits(ds), 1);
    v41_dump_source_free(ds);
    v41_dump_reader_close(r);
}
END_TEST

START_TEST(test_glob)
{
    ck_assert(v41_dump_match(NULL, "x"));
    ck_assert(v41_dump_match("", "x"));
    ck_assert(v41_dump_match("layer.*.attn.q", "layer.12.attn.q"));
    ck_assert(!v41_dump_match("layer.*.attn.q", "layer.12.attn.qr"));
    ck_assert(v41_dump_match("embed,layer.?.ffn*", "layer.3.ffn.out"));
    ck_assert(!v41_dump_match("embed,layer.?.ffn*", "layer.13.ffn.out"));
    ck_assert(v41_dump_match("*", ""));
    ck_assert(v41_dump_match("a*b*c", "axxbyyc"));
    ck_assert(!v41_dump_match("a*b*c", "axxbyy"));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("dump");
    TCase *tc = tcase_create("schema");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_roundtrip_kinds);
    tcase_add_test(tc, test_flat_ranges);
    tcase_add_test(tc, test_not_a_dump);
    tcase_add_test(tc, test_abort_and_sink);
    tcase_add_test(tc, test_glob);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
