/* fuzz_simjson.c: libFuzzer target for the simulator's JSON inputs
 * (sim/sim_cost.c: the measured profile v41-profile/1 and the calibration
 * v41-sim-validate/1; sim/sim_core.c: the acceptance-curve file).
 *
 * Input: byte 0 picks the loader (0 profile, 1 calibration, 2 acceptance),
 * the rest is the file (through a memfd). A loader either fails with a
 * message or returns values the cost model can use: finite ceilings > 0,
 * finite, sorted profile points, finite calibration terms >= 0, and
 * acceptance probabilities in [0, 1]. */
#include "v41_sim.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_profile(const v41_profile *p)
{
    if (!(isfinite(p->peak_flops) && p->peak_flops > 0 && isfinite(p->peak_bw) && p->peak_bw > 0)) abort();
    if (!(isfinite(p->launch_s) && p->launch_s >= 0)) abort();
    for (int c = 0; c < V41_OP_NCLASS; c++) {
        if (p->n[c] < 0 || p->n[c] > V41_PROFILE_MAXPTS) abort();
        for (int k = 0; k < p->n[c]; k++) {
            if (!isfinite(p->x[c][k]) || !isfinite(p->le[c][k])) abort();
            if (k && !(p->x[c][k] > p->x[c][k - 1])) abort();
        }
    }
}

static void check_calib(const v41_calib *c)
{
    double v[] = {c->c0, c->per_row, c->per_request, c->per_mixed_step, c->per_mixed_row};
    for (size_t i = 0; i < sizeof v / sizeof *v; i++)
        if (!(isfinite(v[i]) && v[i] >= 0)) abort();
    for (int k = 0; k < V41_OP_NCLASS; k++)
        if (!(isfinite(c->a[k]) && c->a[k] >= 0)) abort();
}

static void check_accept(const v41_accept *a)
{
    if (a->pmf_len < 1 || a->pmf_len > V41_ACC_MAXLEN + 1) abort();
    double s = 0;
    for (int k = 0; k < a->pmf_len; k++) {
        if (!(a->pmf[k] >= 0 && a->pmf[k] <= 1)) abort();
        s += a->pmf[k];
    }
    if (!(fabs(s - 1) < 1e-9)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    int which = data[0] % 3;
    int fd = memfd_create("simjson", 0);
    if (fd < 0) abort();
    if (size > 1 && write(fd, data + 1, size - 1) != (ssize_t)(size - 1)) abort();
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    v41_err err = {0};
    int rc;
    if (which == 0) {
        static v41_profile p;
        rc = v41_profile_load(path, &p, &err);
        if (!rc) check_profile(&p);
    } else if (which == 1) {
        v41_calib c;
        rc = v41_calib_load(path, &c, &err);
        if (!rc) check_calib(&c);
    } else {
        v41_accept a;
        char spec[80];
        snprintf(spec, sizeof spec, "file:%s", path);
        rc = v41_accept_parse(spec, &a, &err);
        if (!rc) check_accept(&a);
    }
    if (rc && !err.msg[0]) abort();
    close(fd);
    return 0;
}
