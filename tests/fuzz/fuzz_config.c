/* fuzz_config.c: libFuzzer target for the config.json parser. A config that
 * parses must validate, serialise, and parse back to the same struct; the
 * layer-schedule helpers must stay inside the layer range. */
#include "v41_config.h"
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    v41_config c, d;
    v41_err err = {0};
    if (v41_config_parse(buf, size, &c, &err) == V41_OK) {
        if (v41_config_validate(&c, &err) != V41_OK) abort();
        int T = v41_n_total_layers(&c);
        for (int l = 0; l < T; l++) {
            int k = v41_kv_source_of(&c, l), x = v41_index_source_of(&c, l);
            if (k > l || x > l) abort();
            if (c.compress_ratios[l] > 0 && l < c.n_layers && (k < 0 || x < 0)) abort();
            (void)v41_layer_n_experts(&c, l);
        }
        char *s = v41_config_to_json(&c);
        if (!s) abort();
        if (v41_config_parse(s, strlen(s), &d, &err) != V41_OK) abort();
        /* source_form may differ (an HF input serialises as ModelArgs) */
        memcpy(d.source_form, c.source_form, sizeof d.source_form);
        if (memcmp(&c, &d, sizeof c)) abort();
        free(s);
    } else if (!err.msg[0]) {
        abort();
    }
    free(buf);
    return 0;
}
