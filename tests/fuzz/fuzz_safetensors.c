/* fuzz_safetensors.c: libFuzzer target for the safetensors header parser.
 * Any input must either be rejected with an error message or give a weight
 * set whose every tensor lies inside the input (checked by touching every
 * byte under ASan). Build and run: `make fuzz` (needs clang). */
#include "v41_loader_internal.h"
#include "v41_quant.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* a private copy, so ASan reports any read past the end */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    v41_weights *w = NULL;
    v41_err err = {0};
    int rc = v41w_open_buffer(buf, size, "fuzz", &w, &err);
    if (rc == V41_OK) {
        char fp[17];
        v41_weights_fingerprint(w, fp); /* reads every byte of every tensor */
        for (size_t i = 0; i < v41_weights_count(w); i++) {
            const v41_tensor *t = v41_weights_at(w, i);
            if (v41_weights_find(w, t->name) != t) abort();
            if (t->ndim == 2 && t->shape[0] > 0 && t->shape[0] * t->shape[1] <= 4096) {
                float out[4096];
                char sn[1100];
                snprintf(sn, sizeof sn, "%s.scale", t->name);
                v41_dequant_rows(t, v41_weights_find(w, sn), 0, t->shape[0], out, &err);
            }
        }
        v41_config cfg;
        v41_config_tiny(&cfg);
        v41_weights_check_config(w, &cfg, &err);
        v41_weights_close(w);
    } else if (!err.msg[0]) {
        abort(); /* an error without a message */
    }
    free(buf);
    return 0;
}
