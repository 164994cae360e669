/* The output layer of a GGUF model on the CPU, for specdec (specdec/runtime/cpu_head.py).

   logits[j][v] = sum over blocks b of  d_w[v][b] * d_x[j][b] * sum over sub-blocks t of s_w[v][t] * (q_w[v][t] . q_x[j][t])

   with the weights as stored in the file (Q8_0: blocks of 32 int8 with an fp16 scale, one sub-block
   of scale 1; Q6_K: blocks of 256 6-bit weights with an fp16 scale, 16 sub-blocks of 16 with int8
   scales) and each hidden row quantized exactly as llama.cpp does for that matrix (Q8_0 rows,
   quantize_row_q8_0; Q8_K rows, quantize_row_q8_K_ref), so the integer dot products are llama.cpp's.

   Invariants:
   - every logit is computed by the same arithmetic whatever the number of rows: a block's exact
     integer sum, then acc = fma(float(sum), d_w*d_x, acc) over the blocks in order. A row's
     logits are bitwise the same alone or in a batch, and the AVX-512 VNNI path and the portable
     path give the same bits (the fma is fused in both).
   - the matrix is read once per call, for all rows: 16 vocabulary rows (10 KB for a 640-wide
     model) stay in L1 while every hidden row takes its dot products with them.

   Packed layout (pack): groups of 16 vocabulary rows; for group g, column group c (4 weights),
   one 64-byte vector holding weights 4c..4c+3 of each of the 16 rows, as q + offset (unsigned, for
   vpdpbusd; -offset * sum(q_x) over a sub-block takes it back); block scales [g][b][16] as the
   file's fp16; Q6_K's sub-block scales [g][t][16]. Rows past the vocabulary are zero weights with
   zero scales.

   Also here: `specdec_capture`, a ggml eval callback that copies named tensors (the final norm's
   output, decoder layers' inputs) out of llama.cpp's graph and may stop the graph right after one. */

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

/* ---- the matrix formats. A format's block is what one float scale covers (Q8_0: 32 weights;
   Q6_K: 256, with 16 sub-blocks of 16 weights, each with an int8 scale). Weights are packed as
   q + offset, unsigned, for vpdpbusd; -offset * sum(q_x) over a sub-block takes it back. */

typedef struct {
    int block, sub, offset, k_quant;
} Format;

static const Format FORMATS[2] = {{32, 32, 128, 0}, {256, 16, 32, 1}};  /* Q8_0, Q6_K */

/* Hidden rows quantized as llama.cpp does for the format's dot products: Q8_0 rows
   (quantize_row_q8_0: d = amax/127 kept in fp16, q = rint(x * 127/amax)) or Q8_K rows
   (quantize_row_q8_K_ref: with m the element of largest magnitude, q = min(127, rint(x * -127/m)),
   d = 1/(-127/m)); sums: of q, per sub-block. Rounding is half to even, as llama.cpp's. */
static void quantize_rows(const Format *f, const float *x, int64_t rows, int64_t width, int8_t *q, float *d, int32_t *sums) {
    const int64_t blocks = rows * width / f->block, subs = f->block / f->sub;
    for (int64_t i = 0; i < blocks; i++) {
        const float *xb = x + i * f->block;
        int8_t *qb = q + i * f->block;
        float amax = 0.0f, max = 0.0f, inverse;
        for (int t = 0; t < f->block; t++)
            if (fabsf(xb[t]) > amax) { amax = fabsf(xb[t]); max = xb[t]; }
        if (f->k_quant) {
            inverse = amax != 0.0f ? -127.0f / max : 0.0f;
            d[i] = amax != 0.0f ? 1.0f / inverse : 0.0f;
        } else {
            inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
            d[i] = half_to_float(float_to_half(amax / 127.0f));
        }
        for (int t = 0; t < f->block; t++) {
            const int32_t v = (int32_t)nearbyintf(xb[t] * inverse);
            qb[t] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int s = 0; s < subs; s++) {
            int32_t sum = 0;
            for (int t = 0; t < f->sub; t++) sum += qb[s * f->sub + t];
            sums[i * subs + s] = sum;
        }
    }
}

/* ---- the products */

typedef struct {
    Format format;
    const uint8_t *weights;    /* packed: [group][width / 4][16 rows][4 bytes] */
    const uint16_t *scales;    /* packed: [group][block][16 rows], fp16 */
    const int8_t *subscales;   /* Q6_K: [group][sub-block][16 rows] */
    int64_t groups, width, blocks, subs;  /* vocabulary rows / 16 (rounded up); per row: bytes, blocks, sub-blocks */
    const int8_t *xq;          /* rows x width */
    const float *xd;           /* rows x blocks */
    const int32_t *xs;         /* rows x subs */
    int64_t rows, vocab;
    float *out;                /* rows x vocab */
} Product;

static void store(const Product *p, int64_t g, int64_t j, const float *acc) {
    const int64_t first = g * GROUP, n = p->vocab - first < GROUP ? p->vocab - first : GROUP;
    memcpy(p->out + j * p->vocab + first, acc, (size_t)n * sizeof(float));
}

static void groups_portable(const Product *p, int64_t g0, int64_t g1) {
    const Format *f = &p->format;
    const int64_t per_block = f->block / f->sub, columns = p->width / 4;
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t j = 0; j < p->rows; j++) {
            float acc[GROUP] = {0};
            for (int64_t b = 0; b < p->blocks; b++) {
                int32_t total[GROUP] = {0};
                for (int64_t u = b * per_block; u < (b + 1) * per_block; u++) {
                    for (int r = 0; r < GROUP; r++) {
                        int32_t dot = -f->offset * p->xs[j * p->subs + u];
                        for (int64_t c = u * (f->sub / 4); c < (u + 1) * (f->sub / 4); c++)
                            for (int t = 0; t < 4; t++)
                                dot += (int32_t)p->weights[((g * columns + c) * GROUP + r) * 4 + t] * p->xq[j * p->width + c * 4 + t];
                        total[r] += f->k_quant ? dot * p->subscales[(g * p->subs + u) * GROUP + r] : dot;
                    }
                }
                const float xd = p->xd[j * p->blocks + b];
                for (int r = 0; r < GROUP; r++)
                    acc[r] = fmaf((float)total[r], half_to_float(p->scales[(g * p->blocks + b) * GROUP + r]) * xd, acc[r]);
            }
            store(p, g, j, acc);
        }
    }
}

#ifdef HAVE_X86
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* R hidden rows (1-8) against one group: R independent vpdpbusd chains share each weight load
   (one chain alone would wait on the instruction's latency). Integer sums are exact, so how the
   chains are split does not change a bit; the float steps are the portable path's. */
VNNI_TARGET __attribute__((always_inline)) static inline void rows_vnni(const Product *p, int64_t g, int64_t j, const int R, const int kind) {
    const Format f = FORMATS[kind];
    const int64_t per_block = f.block / f.sub, columns = p->width / 4;
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p->blocks; b++) {
        __m512i total[8];
        for (int r = 0; r < R; r++) total[r] = _mm512_setzero_si512();
        for (int64_t u = b * per_block; u < (b + 1) * per_block; u++) {
            __m512i dot[8];
            for (int r = 0; r < R; r++) dot[r] = _mm512_set1_epi32(-f.offset * p->xs[(j + r) * p->subs + u]);
            for (int64_t c = u * (f.sub / 4); c < (u + 1) * (f.sub / 4); c++) {
                const __m512i wv = _mm512_loadu_si512((const void *)(p->weights + (g * columns + c) * GROUP * 4));
                for (int r = 0; r < R; r++) {
                    int32_t x;
                    memcpy(&x, p->xq + (j + r) * p->width + c * 4, 4);
                    dot[r] = _mm512_dpbusd_epi32(dot[r], wv, _mm512_set1_epi32(x));
                }
            }
            if (f.k_quant) {
                const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p->subscales + (g * p->subs + u) * GROUP)));
                for (int r = 0; r < R; r++) total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(dot[r], sc));
            } else {
                for (int r = 0; r < R; r++) total[r] = dot[r];
            }
        }
        const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p->scales + (g * p->blocks + b) * GROUP)));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(ws, _mm512_set1_ps(p->xd[(j + r) * p->blocks + b])), acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float lanes[GROUP];
        _mm512_storeu_ps(lanes, acc[r]);
        store(p, g, j + r, lanes);
    }
}

#define ROWS(R) (kind ? rows_vnni(p, g, j, R, 1) : rows_vnni(p, g, j, R, 0))

VNNI_TARGET static void groups_vnni(const Product *p, int64_t g0, int64_t g1) {
    const int kind = p->format.k_quant;
    for (int64_t g = g0; g < g1; g++) {
        int64_t j = 0;
        for (; j + 8 <= p->rows; j += 8) ROWS(8);
        switch (p->rows - j) {
            case 7: ROWS(7); break;
            case 6: ROWS(6); break;
            case 5: ROWS(5); break;
            case 4: ROWS(4); break;
            case 3: ROWS(3); break;
            case 2: ROWS(2); break;
            case 1: ROWS(1); break;
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

/* ---- Python entry points (buffers in; only the quantized hidden rows are allocated here) */

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

static void release(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

static const Format *format_of(int kind, Py_ssize_t width) {
    if (kind != 0 && kind != 1) { PyErr_SetString(PyExc_ValueError, "kind must be 0 (Q8_0) or 1 (Q6_K)"); return NULL; }
    if (width <= 0 || width % FORMATS[kind].block) {
        PyErr_Format(PyExc_ValueError, "width must be a positive multiple of %d", FORMATS[kind].block);
        return NULL;
    }
    return &FORMATS[kind];
}

/* The i-th weight (0-255) of a Q6_K block as the file stores it (ql[128], qh[64], scales[16], d):
   ggml's dequantize_row_q6_K, element by element. */
static int q6_k_value(const uint8_t *block, int i) {
    const int half = i / 128, quarter = (i % 128) / 32, l = i % 32;
    const uint8_t low = block[64 * half + l + 32 * (quarter & 1)];
    const int nibble = quarter >= 2 ? low >> 4 : low & 0xF, high = (block[128 + 32 * half + l] >> (2 * quarter)) & 3;
    return (nibble | (high << 4)) - 32;
}

/* pack(kind, raw, vocab, width, weights, scales, subscales): raw holds the file's rows of
   blocks (Q8_0: 34 bytes per 32 weights; Q6_K: 210 per 256); subscales is unused for Q8_0. */
static PyObject *pack(PyObject *self, PyObject *args) {
    PyObject *objects[4];
    Py_ssize_t vocab, width;
    int kind;
    if (!PyArg_ParseTuple(args, "iOnnOOO", &kind, &objects[0], &vocab, &width, &objects[1], &objects[2], &objects[3])) return NULL;
    const Format *f = format_of(kind, width);
    if (!f) return NULL;
    if (vocab <= 0) return PyErr_Format(PyExc_ValueError, "the vocabulary must not be empty");
    const int64_t blocks = width / f->block, subs = width / f->sub, groups = (vocab + GROUP - 1) / GROUP;
    const int64_t block_bytes = f->k_quant ? 210 : 34;
    Py_buffer views[4];
    if (readable(objects[0], &views[0], vocab * blocks * block_bytes, "the matrix") < 0) return NULL;
    if (writable(objects[1], &views[1], groups * GROUP * width, "the packed weights") < 0) { release(views, 1); return NULL; }
    if (writable(objects[2], &views[2], groups * GROUP * blocks * 2, "the packed scales") < 0) { release(views, 2); return NULL; }
    if (writable(objects[3], &views[3], f->k_quant ? groups * GROUP * subs : 0, "the packed sub-block scales") < 0) { release(views, 3); return NULL; }
    const uint8_t *source = views[0].buf;
    uint8_t *w = views[1].buf;
    uint16_t *s = views[2].buf;
    int8_t *sub = views[3].buf;
    const int64_t columns = width / 4;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < GROUP; r++) {
            const int64_t v = g * GROUP + r;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *block = source + (v * blocks + b) * block_bytes;
                if (v >= vocab) {  /* padding rows: zero weights, zero scales */
                    s[(g * blocks + b) * GROUP + r] = 0;
                } else {
                    memcpy(&s[(g * blocks + b) * GROUP + r], block + (f->k_quant ? 208 : 0), 2);
                }
                for (int i = 0; i < f->block; i++) {
                    const int64_t column = b * f->block + i, c = column / 4;
                    const int q = v >= vocab ? 0 : f->k_quant ? q6_k_value(block, i) : (int)(int8_t)block[2 + i];
                    w[((g * columns + c) * GROUP + r) * 4 + column % 4] = (uint8_t)(q + f->offset);
                }
                if (f->k_quant)
                    for (int t = 0; t < 16; t++) sub[(g * subs + b * 16 + t) * GROUP + r] = v >= vocab ? 0 : (int8_t)block[192 + t];
            }
        }
    Py_END_ALLOW_THREADS
    release(views, 4);
    Py_RETURN_NONE;
}

/* logits(kind, weights, scales, subscales, vocab, width, hidden, rows, out, threads, portable) */
static PyObject *logits(PyObject *self, PyObject *args) {
    PyObject *objects[5];
    Py_ssize_t vocab, width, rows;
    int kind, threads, portable;
    if (!PyArg_ParseTuple(args, "iOOOnnOnOip", &kind, &objects[0], &objects[1], &objects[2], &vocab, &width, &objects[3], &rows,
                          &objects[4], &threads, &portable))
        return NULL;
    const Format *f = format_of(kind, width);
    if (!f) return NULL;
    if (vocab <= 0 || rows < 0) return PyErr_Format(PyExc_ValueError, "bad shapes");
    const int64_t blocks = width / f->block, subs = width / f->sub, groups = (vocab + GROUP - 1) / GROUP;
    Py_buffer views[5];
    if (readable(objects[0], &views[0], groups * GROUP * width, "the packed weights") < 0) return NULL;
    if (readable(objects[1], &views[1], groups * GROUP * blocks * 2, "the packed scales") < 0) { release(views, 1); return NULL; }
    if (readable(objects[2], &views[2], f->k_quant ? groups * GROUP * subs : 0, "the packed sub-block scales") < 0) { release(views, 2); return NULL; }
    if (readable(objects[3], &views[3], rows * width * 4, "the hidden rows") < 0) { release(views, 3); return NULL; }
    if (writable(objects[4], &views[4], rows * vocab * 4, "the logits") < 0) { release(views, 4); return NULL; }
    int8_t *xq = PyMem_RawMalloc((size_t)(rows * width) + 64);
    float *xd = PyMem_RawMalloc((size_t)(rows * blocks) * 4 + 4);
    int32_t *xs = PyMem_RawMalloc((size_t)(rows * subs) * 4 + 4);
    if (!xq || !xd || !xs) {
        PyMem_RawFree(xq); PyMem_RawFree(xd); PyMem_RawFree(xs);
        release(views, 5);
        return PyErr_NoMemory();
    }
    Product p = {*f, views[0].buf, views[1].buf, views[2].buf, groups, width, blocks, subs, xq, xd, xs, rows, vocab, views[4].buf};
    Py_BEGIN_ALLOW_THREADS
    quantize_rows(f, views[3].buf, rows, width, xq, xd, xs);
    run_product(&p, threads, portable);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(xq); PyMem_RawFree(xd); PyMem_RawFree(xs);
    release(views, 5);
    Py_RETURN_NONE;
}

static PyObject *vnni(PyObject *self, PyObject *args) { return PyBool_FromLong(has_vnni()); }

/* ---- the ggml eval callback (its address is handed to llama.cpp as cb_eval) */

typedef struct Capture {
    const char *(*get_name)(const void *tensor);
    size_t (*nbytes)(const void *tensor);
    void (*tensor_get)(const void *tensor, void *data, size_t offset, size_t size);
    int32_t active;      /* 0: ask for nothing (llama.cpp computes its whole graph in one go) */
    char name[64];       /* the tensor to copy */
    float *dest;
    uint64_t capacity;   /* bytes at dest */
    uint64_t copied;     /* bytes copied since the caller set it to 0: the rows of every ubatch of a decode, in order */
    int32_t overflow;    /* a tensor did not fit: the caller refuses the decode's logits */
    int32_t go_on;       /* 1: llama.cpp finishes its graph after the copy (its own output layer); 0: the graph stops there */
    struct Capture *next;  /* another tensor to copy (a decoder layer's input), or NULL */
} Capture;

bool specdec_capture(const void *tensor, bool ask, void *user_data) {
    for (Capture *c = user_data; c != NULL; c = c->next) {
        if (!c->active || strcmp(c->get_name(tensor), c->name) != 0) continue;
        if (ask) return true;
        const size_t bytes = c->nbytes(tensor);
        if (c->copied + bytes > c->capacity) { c->overflow = 1; return true; }
        c->tensor_get(tensor, (char *)c->dest + c->copied, 0, bytes);
        c->copied += bytes;
        return c->go_on != 0;  /* stopping: the rest of the graph (the output layer) is not computed */
    }
    return false;
}

static PyObject *capture_address(PyObject *self, PyObject *args) { return PyLong_FromVoidPtr((void *)&specdec_capture); }

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS, "Pack a Q8_0 or Q6_K matrix (the file's bytes) for `logits`."},
    {"logits", logits, METH_VARARGS, "Logits of hidden rows against a packed matrix."},
    {"vnni", vnni, METH_NOARGS, "Whether this CPU runs the AVX-512 VNNI path."},
    {"capture_address", capture_address, METH_NOARGS, "The address of the ggml eval callback specdec_capture."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_head", "specdec's CPU output layer (see _cpu_head.c)", -1, methods};

PyMODINIT_FUNC PyInit__cpu_head(void) { return PyModule_Create(&module); }
