/* fuzz_trace.c: libFuzzer target for the simulator's request-trace readers
 * (sim/sim_trace.c: Mooncake JSONL, Azure 2023 CSV, the --synth spec).
 *
 * Input: byte 0 selects the reader (bits 0-1: 0 auto, 1 mooncake, 2 azure,
 * 3 the synthetic generator with the rest as its spec; bit 2: --lenient);
 * the rest is the file (through a memfd) or the spec string. Whatever the
 * input, a reader either fails with a message, or yields records the
 * simulator can use: finite arrival times from 0 on, never decreasing, input
 * and output lengths >= 1, prefix block ids >= 0. */
#include "v41_sim.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_records(v41_trace *t)
{
    v41_trace_rec r;
    v41_err err = {0};
    bool eof = false;
    double last = 0;
    int64_t ids = 0;
    /* bounded: the synthetic generator may be asked for 10^9 records of up to 2^26 prefix-block ids
     * each (legal, only slow), so stop after 4096 records or 2^22 ids */
    for (int i = 0; i < 4096 && ids < (1 << 22); i++) {
        int rc = v41_trace_next(t, &r, &eof, &err);
        if (rc) {
            if (!err.msg[0]) abort();
            return;
        }
        if (eof) return;
        if (!isfinite(r.t_arrive) || r.t_arrive < 0 || r.t_arrive < last) abort();
        if (r.in_len < 1 || r.out_len < 1 || r.n_hash < 0) abort();
        for (int k = 0; k < r.n_hash; k++)
            if (r.hash[k] < 0) abort();
        double p = v41_trace_progress(t);
        if (!(p == -1 || (p >= 0 && p <= 1))) abort();
        last = r.t_arrive;
        ids += r.n_hash;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    int mode = data[0] & 3;
    bool lenient = (data[0] >> 2) & 1;
    v41_trace *t = NULL;
    v41_err err = {0};
    int rc;
    if (mode == 3) {
        char *spec = malloc(size);
        if (!spec) return 0;
        memcpy(spec, data + 1, size - 1);
        spec[size - 1] = 0;
        rc = v41_trace_open_synth(spec, &t, &err);
        free(spec);
    } else {
        int fd = memfd_create("trace", 0);
        if (fd < 0) abort();
        if (size > 1 && write(fd, data + 1, size - 1) != (ssize_t)(size - 1)) abort();
        char path[64];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        static const char *fmt[] = {"auto", "mooncake", "azure"};
        rc = v41_trace_open(path, fmt[mode], lenient, &t, &err);
        close(fd);   /* the reader holds its own descriptor */
    }
    if (rc) {
        if (!err.msg[0] || t) abort();
        return 0;
    }
    check_records(t);
    v41_trace_close(t);
    return 0;
}
