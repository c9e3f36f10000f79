/* v41_dump_fixture: writes synthetic v41 dumps for the harness shell tests.
 *
 *   v41_dump_fixture OUT.h5 [--perturb STEP:NAME:DELTA] [--flip STEP:NAME]
 *                           [--precision P] [--engine E] [--mb N]
 *
 * The content is a deterministic function of (step, name, index), shaped
 * like a 2-layer model: "embed", per layer "layer.{l}.stream.in",
 * "layer.{l}.attn.q" (bf16), "layer.{l}.attn.topk" (i32, -1 padded),
 * "layer.{l}.attn.out", "layer.{l}.ffn.gate.indices", "layer.{l}.ffn.out",
 * "layer.{l}.stream.out", then "logits" and "tokens". --perturb adds DELTA
 * to element 7 of that tap AND (like a real bug) to every later float tap
 * of that step; --flip changes one top-k entry. --mb N appends float taps
 * "bulk.{i}" of 4 Mi elements until the data reaches N MiB (uncompressed
 * writing, for the bounded-memory test). */
#include "v41_dump.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float val(int step, int salt, int64_t i)
{
    /* smooth, deterministic, sign-varying values of magnitude ~1 */
    return (float)sin(0.37 * (double)i + 1.3 * step + 0.71 * salt) * (1.0f + 0.25f * (float)((i + salt) % 5));
}

static float bf16_round(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    memcpy(&x, &u, 4);
    return x;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: v41_dump_fixture OUT.h5 [--perturb STEP:NAME:DELTA] [--flip STEP:NAME] "
                        "[--precision P] [--engine E] [--mb N]\n");
        return 2;
    }
    const char *out = argv[1], *prec = "emulate", *engine = "ref";
    int p_step = -1, f_step = -1, mb = 0;
    char p_name[256] = "", f_name[256] = "";
    double p_delta = 0;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--perturb") && i + 1 < argc) {
            char buf[512];
            snprintf(buf, sizeof buf, "%s", argv[++i]);
            char *a = strchr(buf, ':'), *b = a ? strrchr(buf, ':') : NULL;
            if (!a || a == b) { fprintf(stderr, "bad --perturb\n"); return 2; }
            *a = 0; *b = 0;
            p_step = atoi(buf);
            snprintf(p_name, sizeof p_name, "%s", a + 1);
            p_delta = atof(b + 1);
        } else if (!strcmp(argv[i], "--flip") && i + 1 < argc) {
            char buf[512];
            snprintf(buf, sizeof buf, "%s", argv[++i]);
            char *a = strchr(buf, ':');
            if (!a) { fprintf(stderr, "bad --flip\n"); return 2; }
            *a = 0;
            f_step = atoi(buf);
            snprintf(f_name, sizeof f_name, "%s", a + 1);
        } else if (!strcmp(argv[i], "--precision") && i + 1 < argc) prec = argv[++i];
        else if (!strcmp(argv[i], "--engine") && i + 1 < argc) engine = argv[++i];
        else if (!strcmp(argv[i], "--mb") && i + 1 < argc) mb = atoi(argv[++i]);
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
    }
    v41_dump_meta m = {.engine = engine, .precision = prec, .compat = "fixed", .replay = "on",
                       .config_json = "{\"n_layers\":2}", .model = "fixture", .threads = 1};
    v41_dump *d;
    v41_err err = {0};
    if (v41_dump_create(out, &m, &d, &err)) { fprintf(stderr, "%s\n", err.msg); return 2; }
    int32_t ids[2] = {0, 1}, plen[2] = {3, 3};
    v41_dump_set_requests(d, 2, ids, plen, NULL, &err);
    const int D = 16, H = 2, HD = 8, K = 4, V = 32;
    float *buf = malloc(sizeof(float) * (1 << 22));
    int32_t ibuf[64];
    for (int step = 0; step < 3; step++) {
        int T = step == 0 ? 6 : 2;   /* prefill 2x3 rows, then 1 row per request */
        int32_t req[6], pos[6];
        for (int r = 0; r < T; r++) {
            req[r] = step == 0 ? r / 3 : r;
            pos[r] = step == 0 ? r % 3 : 2 + step;
        }
        v41_dump_set_rows(d, step, T, req, pos, &err);
        int order = 0;
        bool perturbing = false;
        struct { const char *fmt; int layer; v41_tap_kind kind; int kindsel; } plan[] = {
            {"layer.%d.stream.in", 0, V41_TAP_F32, 0}, {"layer.%d.attn.q", 0, V41_TAP_BF16, 1},
            {"layer.%d.attn.topk", 0, V41_TAP_I32, 2}, {"layer.%d.attn.out", 0, V41_TAP_F32, 0},
            {"layer.%d.ffn.gate.indices", 0, V41_TAP_I32, 3}, {"layer.%d.ffn.out", 0, V41_TAP_F32, 0},
            {"layer.%d.stream.out", 0, V41_TAP_F32, 0},
        };
        /* embed */
        for (int i = 0; i < T * D; i++) buf[i] = bf16_round(val(step, 1, i));
        v41_tap t = {.name = "embed", .step = step, .layer = -1, .kind = V41_TAP_BF16, .ndim = 2,
                     .shape = {T, D}, .data = buf, .order = order++};
        if (v41_dump_write_tap(d, &t, &err)) goto fail;
        for (int l = 0; l < 2; l++) {
            for (size_t p = 0; p < sizeof plan / sizeof plan[0]; p++) {
                char name[128];
                snprintf(name, sizeof name, plan[p].fmt, l);
                int salt = (int)(10 * l + p + 2);
                v41_tap tt = {.name = name, .step = step, .layer = l, .kind = plan[p].kind, .order = order++};
                if (plan[p].kindsel == 2 || plan[p].kindsel == 3) {
                    int kk = plan[p].kindsel == 2 ? K : 2;
                    for (int r = 0; r < T; r++)
                        for (int j = 0; j < kk; j++)
                            ibuf[r * kk + j] = plan[p].kindsel == 2 ? (j <= r + step ? (r + 3 * j + l) % 11 : -1)
                                                                    : (r + j * 3 + l) % 8;
                    if (step == f_step && !strcmp(name, f_name)) ibuf[kk] = 20;   /* row 1, col 0: a value no row holds */
                    tt.ndim = 2; tt.shape[0] = T; tt.shape[1] = kk; tt.data = ibuf;
                } else {
                    int64_t n = plan[p].kindsel == 1 ? (int64_t)T * H * HD : (int64_t)T * D;
                    for (int64_t i = 0; i < n; i++) {
                        buf[i] = val(step, salt, i);
                        if (plan[p].kind == V41_TAP_BF16) buf[i] = bf16_round(buf[i]);
                    }
                    if (step == p_step && !strcmp(name, p_name)) perturbing = true;
                    if (perturbing) buf[7] += (float)p_delta;
                    if (plan[p].kindsel == 1) { tt.ndim = 3; tt.shape[0] = T; tt.shape[1] = H; tt.shape[2] = HD; }
                    else { tt.ndim = 2; tt.shape[0] = T; tt.shape[1] = D; }
                    tt.data = buf;
                }
                if (v41_dump_write_tap(d, &tt, &err)) goto fail;
            }
        }
        int nreq = 2;
        for (int i = 0; i < nreq * V; i++) buf[i] = val(step, 99, i) * 3 + (perturbing ? (float)p_delta : 0);
        v41_tap lg = {.name = "logits", .step = step, .layer = -1, .kind = V41_TAP_F32, .ndim = 2,
                      .shape = {nreq, V}, .data = buf, .order = order++};
        if (v41_dump_write_tap(d, &lg, &err)) goto fail;
        int32_t tok[2] = {5 + step, 9 + step};
        if (step == f_step && !strcmp("tokens", f_name)) tok[1]++;
        v41_tap tk = {.name = "tokens", .step = step, .layer = -1, .kind = V41_TAP_I32, .ndim = 1,
                      .shape = {nreq}, .data = tok, .order = order++};
        if (v41_dump_write_tap(d, &tk, &err)) goto fail;
    }
    if (mb > 0) {
        /* bulk taps, uncompressed: the file is as large as the data */
        v41_dump_set_deflate(d, 0);
        const int64_t n = 1 << 22;
        for (int i = 0; (int64_t)i * n * 4 < (int64_t)mb << 20; i++) {
            for (int64_t j = 0; j < n; j++) buf[j] = (float)((j * 2654435761u + (uint64_t)i) % 1000) * 1e-3f;
            char name[64];
            snprintf(name, sizeof name, "bulk.%d", i);
            v41_tap b = {.name = name, .step = 3, .layer = -1, .kind = V41_TAP_F32, .ndim = 2,
                         .shape = {n / 1024, 1024}, .data = buf, .order = i};
            if (v41_dump_write_tap(d, &b, &err)) goto fail;
        }
    }
    free(buf);
    if (v41_dump_close(d, &err)) { fprintf(stderr, "%s\n", err.msg); return 2; }
    return 0;
fail:
    free(buf);
    fprintf(stderr, "%s\n", err.msg);
    v41_dump_abort(d);
    return 2;
}
