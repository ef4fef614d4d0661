/* Host-to-host copies with non-temporal (streaming) stores, for the save snapshot.
 *
 * Why: a snapshot writes hundreds of MiB that only the writer threads read back, later. Ordinary
 * stores first read every destination cache line (read-for-ownership) and evict the training
 * job's data; streaming stores skip both. glibc's memmove streams only above roughly the L3 size
 * per call, which a snapshot's per-tensor pieces never reach: here, 2 ranks copying 552 MiB each
 * took 0.06 s with streaming stores against 0.10-0.12 s with memmove or torch's copy_.
 * Source and destination must not overlap. Other architectures get memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

static void stream_copy(char *dst, const char *src, size_t n)
{
#if STREAMING
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* streaming stores need 16-byte alignment */
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence(); /* streamed data is visible to other threads once the call returns */
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *py_copy(PyObject *self, PyObject *args)
{
    unsigned long long dst, src;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "KKn", &dst, &src, &n))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy: negative byte count");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS, "copy(dst_address, src_address, nbytes): non-overlapping host copy"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hostcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hostcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
