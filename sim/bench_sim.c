/* bench_sim.c: `make bench` entry of the simulator: the whole Mooncake conversation
 * trace (../shared/traces, else the 200-line sample in traces/) with replay on, the
 * default Flash model and roofline costs; prints wall time and events/s. Speed target
 * (README.md, section 'Simulator'): <= 30 s on one core. Not a test: it never fails on time. */
#include "config.h"
#include "v41_sim.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    char path[4096];
    const char *src = getenv("V41_SRCDIR") ? getenv("V41_SRCDIR") : V41_SRCDIR;
    snprintf(path, sizeof path, "%s", argc > 1 ? argv[1] : "");
    if (!path[0]) {
        snprintf(path, sizeof path, "%s/../shared/traces/mooncake/conversation_trace.jsonl", src);
        if (access(path, R_OK)) snprintf(path, sizeof path, "%s/traces/mooncake_conversation_head200.jsonl", src);
    }
    static v41_sim_opts o;
    static v41_sim_result res;
    v41_err err = {0};
    v41_sim_opts_default(&o);
    if (v41_sim_config_flash(&o.cfg, &err)) { fprintf(stderr, "bench_sim: %s\n", err.msg); return 2; }
    snprintf(o.model_name, sizeof o.model_name, "flash");
    v41_trace *t;
    if (v41_trace_open(path, "auto", false, &t, &err)) { fprintf(stderr, "bench_sim: %s\n", err.msg); return 2; }
    int rc = v41_sim_run(&o, t, NULL, &res, &err);
    v41_trace_close(t);
    if (rc) { fprintf(stderr, "bench_sim: %s\n", err.msg); return 2; }
    printf("bench_sim: %s\n  %lld requests, %lld events (%lld steps), replay on: %.2f s wall, %.3g events/s "
           "(target: whole trace <= 30 s on one core)\n",
           path, (long long)res.n_requests, (long long)res.events, (long long)res.steps, res.wall_s,
           res.wall_s > 0 ? res.events / res.wall_s : 0);
    return 0;
}
