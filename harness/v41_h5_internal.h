/* v41_h5_internal.h: HDF5 helpers of libv41harness shared with the v41 binary; not installed. */
#ifndef V41_H5_INTERNAL_H
#define V41_H5_INTERNAL_H

#include <hdf5.h>
#include <stddef.h>

/* Attribute key of obj as text in buf (cap bytes, always terminated): a fixed or variable-length
 * string, or an integer or float printed. 0, or -1 when absent, not one value (an array attribute
 * would overrun the one value read) or of another type. */
int v41_h5_attr_str(hid_t obj, const char *key, char *buf, size_t cap);

#endif
