/* test_model.h: the model the engine test suites run on (include after check.h and
 * v41_engine.h): the oracle's tiny checkpoint when V41_ORACLE_DIR names a directory
 * with a config.json, else the built-in tiny model. A load failure fails the test. */
#ifndef V41_TEST_MODEL_H
#define V41_TEST_MODEL_H
#include <stdio.h>
#include <stdlib.h>

static inline v41_model *test_model_load(void)
{
    v41_model *m = NULL;
    v41_err err = {0};
    const char *dir = getenv("V41_ORACLE_DIR");
    char p[4096];
    FILE *f = NULL;
    if (dir) {
        snprintf(p, sizeof p, "%s/config.json", dir);
        f = fopen(p, "r");
    }
    if (f) fclose(f);
    ck_assert_msg(v41_model_load(f ? dir : "tiny", &m, &err) == 0, "model: %s", err.msg);
    return m;
}
#endif
