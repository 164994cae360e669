/* The output layer of a GGUF model on the CPU, for specdec (specdec/runtime/cpu_head.py).

   logits[j][v] = sum over 32-blocks b of  d_w[v][b] * d_x[j][b] * (q_w[v][b] . q_x[j][b])

   with the weights as stored in the file (Q8_0: an fp16 scale and 32 int8 per block) and each
   hidden row quantized to Q8_0 exactly as llama.cpp's quantize_row_q8_0 does (d = amax/127 kept
   in fp16, q = round-half-even(x * 127/amax)), so the integer dot products are llama.cpp's.

   Invariants:
   - every logit is computed by the same arithmetic whatever the number of rows: the integer dot
     of a block, then acc = fma(float(dot), d_w*d_x, acc) over the blocks in order. A row's
     logits are bitwise the same alone or in a batch, and the AVX-512 VNNI path and the portable
     path give the same bits (the fma is fused in both).
   - the matrix is read once per call, for all rows: 16 vocabulary rows (10 KB for a 640-wide
     model) stay in L1 while every hidden row takes its dot products with them.

   Packed layout (pack_q8_0): groups of 16 vocabulary rows; for group g and block b, eight 64-byte
   vectors, vector c holding bytes 4c..4c+3 of the block of each of the 16 rows, as q + 128
   (unsigned, for vpdpbusd; the offset is taken back with -128 * sum(q_x) per block); scales
   [g][b][16] as the file's fp16. Rows past the vocabulary are zero weights with zero scales.

   Also here: `specdec_capture`, a ggml eval callback that copies one named tensor (the final
   norm's output) out of llama.cpp's graph and can stop the graph right after it. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86 1
#endif

#define GROUP 16
#define QBLOCK 32

/* ---- fp16 <-> fp32, round to nearest even (as F16C and ggml do) */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400)) { mantissa <<= 1; exponent--; }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exponent = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mantissa = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mantissa ? 0x200 : 0));
    if (exponent >= 31) return (uint16_t)(sign | 0x7c00);
    if (exponent <= 0) {  /* subnormal or zero in fp16 */
        if (exponent < -10) return (uint16_t)sign;
        mantissa |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exponent);
        uint32_t half = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), midpoint = 1u << (shift - 1);
        if (rest > midpoint || (rest == midpoint && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)exponent << 10) | (mantissa >> 13), rest = mantissa & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;  /* may carry into the exponent: still right */
    return (uint16_t)(sign | half);
}

/* ---- quantizing hidden rows to Q8_0 (llama.cpp's quantize_row_q8_0) */

static void quantize_rows(const float *x, int64_t rows, int64_t width, int8_t *q, float *d, int32_t *sums) {
    const int64_t blocks = width / QBLOCK;
    for (int64_t i = 0; i < rows * blocks; i++) {
        const float *xb = x + i * QBLOCK;
        float amax = 0.0f;
        for (int t = 0; t < QBLOCK; t++) amax = fmaxf(amax, fabsf(xb[t]));
        const float scale = amax / 127.0f, inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int t = 0; t < QBLOCK; t++) {
            const int32_t v = (int32_t)nearbyintf(xb[t] * inverse);
            q[i * QBLOCK + t] = (int8_t)v;
            sum += v;
        }
        d[i] = half_to_float(float_to_half(scale));
        sums[i] = sum;
    }
}

/* ---- the products */

typedef struct {
    const uint8_t *weights;  /* packed */
    const uint16_t *scales;  /* packed (fp16) */
    int64_t groups, blocks;  /* vocabulary rows / 16 (rounded up), width / 32 */
    const int8_t *xq;        /* rows x width */
    const float *xd;         /* rows x blocks */
    const int32_t *xs;       /* rows x blocks */
    int64_t rows, vocab;
    float *out;              /* rows x vocab */
} Product;

static void store(const Product *p, int64_t g, int64_t j, const float *acc) {
    const int64_t first = g * GROUP, n = p->vocab - first < GROUP ? p->vocab - first : GROUP;
    memcpy(p->out + j * p->vocab + first, acc, (size_t)n * sizeof(float));
}

static void groups_portable(const Product *p, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t j = 0; j < p->rows; j++) {
            float acc[GROUP] = {0};
            for (int64_t b = 0; b < p->blocks; b++) {
                const uint8_t *w = p->weights + (g * p->blocks + b) * GROUP * QBLOCK;
                const int8_t *x = p->xq + (j * p->blocks + b) * QBLOCK;
                const uint16_t *ws = p->scales + (g * p->blocks + b) * GROUP;
                const float xd = p->xd[j * p->blocks + b];
                for (int r = 0; r < GROUP; r++) {
                    int32_t dot = -128 * p->xs[j * p->blocks + b];
                    for (int c = 0; c < QBLOCK / 4; c++)
                        for (int t = 0; t < 4; t++) dot += (int32_t)w[(c * GROUP + r) * 4 + t] * x[c * 4 + t];
                    acc[r] = fmaf((float)dot, half_to_float(ws[r]) * xd, acc[r]);
                }
            }
            store(p, g, j, acc);
        }
    }
}

#ifdef HAVE_X86
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* R hidden rows (1-4) against one group: R independent vpdpbusd chains share each weight load
   (one chain alone would wait on the instruction's latency). Integer sums are exact, so how the
   chains are split does not change a bit. */
VNNI_TARGET __attribute__((always_inline)) static inline void rows_vnni(const Product *p, int64_t g, int64_t j, const int R) {
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p->blocks; b++) {
        const uint8_t *w = p->weights + (g * p->blocks + b) * GROUP * QBLOCK;
        __m512i dot[8];
        const int32_t *x[8];
        for (int r = 0; r < R; r++) {
            dot[r] = _mm512_set1_epi32(-128 * p->xs[(j + r) * p->blocks + b]);
            x[r] = (const int32_t *)(p->xq + ((j + r) * p->blocks + b) * QBLOCK);
        }
        for (int c = 0; c < QBLOCK / 4; c++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + c * 64));
            for (int r = 0; r < R; r++) dot[r] = _mm512_dpbusd_epi32(dot[r], wv, _mm512_set1_epi32(x[r][c]));
        }
        const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p->scales + (g * p->blocks + b) * GROUP)));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(ws, _mm512_set1_ps(p->xd[(j + r) * p->blocks + b])), acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float lanes[GROUP];
        _mm512_storeu_ps(lanes, acc[r]);
        store(p, g, j + r, lanes);
    }
}

VNNI_TARGET static void groups_vnni(const Product *p, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        int64_t j = 0;
        for (; j + 8 <= p->rows; j += 8) rows_vnni(p, g, j, 8);
        switch (p->rows - j) {
            case 7: rows_vnni(p, g, j, 7); break;
            case 6: rows_vnni(p, g, j, 6); break;
            case 5: rows_vnni(p, g, j, 5); break;
            case 4: rows_vnni(p, g, j, 4); break;
            case 3: rows_vnni(p, g, j, 3); break;
            case 2: rows_vnni(p, g, j, 2); break;
            case 1: rows_vnni(p, g, j, 1); break;
        }
    }
}

static int has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#else
static int has_vnni(void) { return 0; }
#endif

static void run_product(const Product *p, int threads, int portable) {
    const int vnni = !portable && has_vnni();
    if (threads < 1) threads = 1;
    #pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        extern int omp_get_num_threads(void);
        const int64_t id = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int64_t id = 0, n = 1;
#endif
        const int64_t g0 = p->groups * id / n, g1 = p->groups * (id + 1) / n;
#ifdef HAVE_X86
        if (vnni) groups_vnni(p, g0, g1); else
#endif
        groups_portable(p, g0, g1);
    }
}

/* ---- Python entry points (buffers in, nothing allocated here) */

static int writable(PyObject *object, Py_buffer *view, Py_ssize_t bytes, const char *what) {
    if (PyObject_GetBuffer(object, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len < bytes) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, %zd needed", what, view->len, bytes);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int readable(PyObject *object, Py_buffer *view, Py_ssize_t bytes, const char *what) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len < bytes) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, %zd needed", what, view->len, bytes);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* pack_q8_0(raw, vocab, width, weights_out, scales_out): raw is the file's Q8_0 rows (34 bytes per block) */
static PyObject *pack_q8_0(PyObject *self, PyObject *args) {
    PyObject *raw_o, *weights_o, *scales_o;
    Py_ssize_t vocab, width;
    if (!PyArg_ParseTuple(args, "OnnOO", &raw_o, &vocab, &width, &weights_o, &scales_o)) return NULL;
    if (vocab <= 0 || width <= 0 || width % QBLOCK) return PyErr_Format(PyExc_ValueError, "width must be a positive multiple of %d", QBLOCK);
    const int64_t blocks = width / QBLOCK, groups = (vocab + GROUP - 1) / GROUP;
    Py_buffer raw, weights, scales;
    if (readable(raw_o, &raw, vocab * blocks * 34, "the Q8_0 matrix") < 0) return NULL;
    if (writable(weights_o, &weights, groups * GROUP * width, "the packed weights") < 0) { PyBuffer_Release(&raw); return NULL; }
    if (writable(scales_o, &scales, groups * GROUP * blocks * 2, "the packed scales") < 0) {
        PyBuffer_Release(&raw); PyBuffer_Release(&weights); return NULL;
    }
    const uint8_t *source = raw.buf;
    uint8_t *w = weights.buf;
    uint16_t *s = scales.buf;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < blocks; b++)
            for (int r = 0; r < GROUP; r++) {
                const int64_t v = g * GROUP + r;
                uint8_t *target = w + (g * blocks + b) * GROUP * QBLOCK;
                if (v >= vocab) {
                    for (int c = 0; c < QBLOCK / 4; c++) memset(target + (c * GROUP + r) * 4, 128, 4);
                    s[(g * blocks + b) * GROUP + r] = 0;
                    continue;
                }
                const uint8_t *block = source + (v * blocks + b) * 34;
                memcpy(&s[(g * blocks + b) * GROUP + r], block, 2);
                for (int c = 0; c < QBLOCK / 4; c++)
                    for (int t = 0; t < 4; t++) target[(c * GROUP + r) * 4 + t] = (uint8_t)((int)(int8_t)block[2 + c * 4 + t] + 128);
            }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&raw); PyBuffer_Release(&weights); PyBuffer_Release(&scales);
    Py_RETURN_NONE;
}

/* logits(weights, scales, vocab, width, hidden, rows, out, threads, portable) */
static PyObject *logits(PyObject *self, PyObject *args) {
    PyObject *weights_o, *scales_o, *hidden_o, *out_o;
    Py_ssize_t vocab, width, rows;
    int threads, portable;
    if (!PyArg_ParseTuple(args, "OOnnOnOip", &weights_o, &scales_o, &vocab, &width, &hidden_o, &rows, &out_o, &threads, &portable))
        return NULL;
    if (vocab <= 0 || width <= 0 || width % QBLOCK || rows < 0) return PyErr_Format(PyExc_ValueError, "bad shapes");
    const int64_t blocks = width / QBLOCK, groups = (vocab + GROUP - 1) / GROUP;
    Py_buffer weights, scales, hidden, out;
    if (readable(weights_o, &weights, groups * GROUP * width, "the packed weights") < 0) return NULL;
    if (readable(scales_o, &scales, groups * GROUP * blocks * 2, "the packed scales") < 0) { PyBuffer_Release(&weights); return NULL; }
    if (readable(hidden_o, &hidden, rows * width * 4, "the hidden rows") < 0) {
        PyBuffer_Release(&weights); PyBuffer_Release(&scales); return NULL;
    }
    if (writable(out_o, &out, rows * vocab * 4, "the logits") < 0) {
        PyBuffer_Release(&weights); PyBuffer_Release(&scales); PyBuffer_Release(&hidden); return NULL;
    }
    int8_t *xq = PyMem_RawMalloc((size_t)(rows * width) + 64);
    float *xd = PyMem_RawMalloc((size_t)(rows * blocks) * 4 + 4);
    int32_t *xs = PyMem_RawMalloc((size_t)(rows * blocks) * 4 + 4);
    if (!xq || !xd || !xs) {
        PyMem_RawFree(xq); PyMem_RawFree(xd); PyMem_RawFree(xs);
        PyBuffer_Release(&weights); PyBuffer_Release(&scales); PyBuffer_Release(&hidden); PyBuffer_Release(&out);
        return PyErr_NoMemory();
    }
    Product p = {weights.buf, scales.buf, groups, blocks, xq, xd, xs, rows, vocab, out.buf};
    Py_BEGIN_ALLOW_THREADS
    quantize_rows(hidden.buf, rows, width, xq, xd, xs);
    run_product(&p, threads, portable);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(xq); PyMem_RawFree(xd); PyMem_RawFree(xs);
    PyBuffer_Release(&weights); PyBuffer_Release(&scales); PyBuffer_Release(&hidden); PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyObject *vnni(PyObject *self, PyObject *args) { return PyBool_FromLong(has_vnni()); }

/* ---- the ggml eval callback (its address is handed to llama.cpp as cb_eval) */

typedef struct {
    const char *(*get_name)(const void *tensor);
    size_t (*nbytes)(const void *tensor);
    void (*tensor_get)(const void *tensor, void *data, size_t offset, size_t size);
    int32_t active;      /* 0: ask for nothing (llama.cpp computes its whole graph in one go) */
    int32_t stop;        /* stop the graph once the tensor is copied */
    char name[64];       /* the tensor to copy */
    float *dest;
    uint64_t capacity;   /* bytes at dest */
    uint64_t copied;     /* bytes copied since the caller set it to 0: the rows of every ubatch of a decode, in order */
    int32_t overflow;    /* a tensor did not fit: the caller refuses the decode's logits */
} Capture;

bool specdec_capture(const void *tensor, bool ask, void *user_data) {
    Capture *c = user_data;
    if (!c->active || strcmp(c->get_name(tensor), c->name) != 0) return false;
    if (ask) return true;
    const size_t bytes = c->nbytes(tensor);
    if (c->copied + bytes > c->capacity) { c->overflow = 1; return true; }
    c->tensor_get(tensor, (char *)c->dest + c->copied, 0, bytes);
    c->copied += bytes;
    return !c->stop;
}

static PyObject *capture_address(PyObject *self, PyObject *args) { return PyLong_FromVoidPtr((void *)&specdec_capture); }

static PyMethodDef methods[] = {
    {"pack_q8_0", pack_q8_0, METH_VARARGS, "Pack a Q8_0 matrix (the file's bytes) for `logits`."},
    {"logits", logits, METH_VARARGS, "Logits of hidden rows against a packed Q8_0 matrix."},
    {"vnni", vnni, METH_NOARGS, "Whether this CPU runs the AVX-512 VNNI path."},
    {"capture_address", capture_address, METH_NOARGS, "The address of the ggml eval callback specdec_capture."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_head", "specdec's CPU output layer (see _cpu_head.c)", -1, methods};

PyMODINIT_FUNC PyInit__cpu_head(void) { return PyModule_Create(&module); }
