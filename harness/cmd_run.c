/* placeholder: replaced by its owner */
#include "v41_cli.h"
int v41_cmd_run(int argc, char **argv) { (void)argc; fprintf(stderr, "v41 %s: not available in this build yet\n", argv[0]); return 2; }
int v41_cmd_taps(int argc, char **argv) { (void)argc; fprintf(stderr, "v41 %s: not available in this build yet\n", argv[0]); return 2; }
