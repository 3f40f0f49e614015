/*
 * The layers of a decode-only step in one call: the same kernels, in the same order, as
 * models/llama_cpu.py's per-op loop (so the same outputs, bit for bit), without the ~9 Python-side
 * calls per layer between them, which cost ~1 ms of a ~5 ms step of a small quantized model at
 * batch 1. The layout of these structs is cpu_kernels/decode_step.py's; a linear whose format is
 * -1 is a float weight on kvg_linear, any other the quantized kernel's format through quant_linear
 * (kvq_linear of quant_kernels.c, a separate library: its address is passed in). decode_kernels.c includes
 * this file last, after every kernel the step calls.
 */
typedef void (*QuantLinear)(const void *x, const void *w, const float *scales, const void *bias, void *y,
                            int64_t ldy, int M, int64_t N, int64_t K, int fmt, int dt, int accumulate);
/* kvq_linear_tiles: tiles [t0, t1) of a one-row product, then the first lines of next asked for */
typedef void (*QuantTiles)(const void *x, const void *w, const float *scales, const void *bias, void *y, int64_t N,
                           int64_t K, int fmt, int dt, int accumulate, int64_t t0, int64_t t1, const void *next);

typedef struct {
    const void *weight; /* [N, K] of the model dtype, or the quantized kernel's tiles */
    const float *scales;
    const void *bias;
    int64_t n, k;
    int format;
    int64_t tile_bytes; /* a quantized weight's bytes per tile of QUANT_TILE rows (its tiled layout) */
    const void *amx;    /* the weight's bfloat16 copy in AMX tiles (amx_gemm.h), or NULL */
} StepLinear;

typedef struct {
    const void *input_norm, *post_norm;
    StepLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    int window;
    /* Gemma 3 (StepModel.gemma): its norms' float32 scales (1 + weight; input_norm and post_norm too), the q and k
       heads' norms, and the layer's rotary tables (the sliding-window layers have their own) */
    const float *pre_ffn_norm, *post_ffn_norm, *q_norm, *k_norm;
    const void *cos, *sin;
} StepLayer;

typedef struct {
    int num_layers, heads, kv_heads, head_dim, block_size, dt;
    int64_t hidden, intermediate;
    float eps, scale;
    const void *cos, *sin;
    QuantLinear quant_linear;
    QuantTiles quant_tiles;
    int team; /* every product quantized in a format quant_tiles takes: one-row steps run as one team */
    int gemv_rows; /* rows up to which a float weight with an AMX copy still takes the GEMV */
    int quant_tile_rows; /* rows from which a packed weight with an AMX copy takes it (quant/matmul.py AMX_ROWS) */
    const StepLayer *layers;
    int gemma; /* the layers are Gemma 3's (decode_layers_gemma) */
} StepModel;

typedef struct {
    void *hidden, *normed, *qkv, *attn, *gate_up, *act; /* rows of hidden, qkv_width, H * D, 2 I, I */
} StepBuffers;

static void step_linear(const StepModel *m, const StepLinear *l, const void *x, void *y, int64_t ldy, int rows,
                        int accumulate) {
    const int tiles = l->format < 0 ? rows > m->gemv_rows : rows >= m->quant_tile_rows;
    if (l->amx && tiles && kvg_tile_linear(x, l->k, l->amx, l->bias, y, ldy, rows, l->n, l->k, accumulate))
        return;
    if (l->format < 0)
        kvg_linear(x, l->weight, l->bias, y, ldy, rows, l->n, l->k, m->dt, accumulate);
    else
        m->quant_linear(x, l->weight, l->scales, l->bias, y, ldy, rows, l->n, l->k, l->format, m->dt, accumulate);
}

/*
 * One row on quantized weights, the whole step in one OpenMP team: each thread takes a fixed share of
 * every product's tiles and streams its shares one after another, asking for the start of its next
 * share as it ends one (one thread does the small ops between; during the input norm the others ask
 * for more of their qkv share). A team per kernel call instead starts and joins ~9 times a layer,
 * each product's stream starting cold: on a small model's small products (576 x 576), a few
 * microseconds each, a tenth of a step. The outputs are the per-call loop's: each tile's sums and
 * every small op are computed as there, only by other threads.
 */
#define QUANT_TILE 8 /* rows per tile of the quantized layout (quant_kernels.c TILE) */
#define TEAM_PREFETCH 16384 /* bytes of its next share a thread asks for while another does a small op */

static void share_of(const StepLinear *l, int part, int parts, int64_t *t0, int64_t *t1) {
    const int64_t tiles = (l->n + QUANT_TILE - 1) / QUANT_TILE;
    *t0 = tiles * part / parts, *t1 = tiles * (part + 1) / parts;
}

static const void *share_start(const StepLinear *l, int part, int parts) {
    int64_t t0, t1;
    share_of(l, part, parts, &t0, &t1);
    return t0 < t1 ? (const char *)l->weight + t0 * l->tile_bytes : NULL;
}

static void team_linear(const StepModel *m, const StepLinear *l, const StepLinear *next, const void *x, void *y,
                        int accumulate, int part, int parts) {
    int64_t t0, t1;
    share_of(l, part, parts, &t0, &t1);
    if (t0 < t1)
        m->quant_tiles(x, l->weight, l->scales, l->bias, y, l->n, l->k, l->format, m->dt, accumulate, t0, t1,
                       next ? share_start(next, part, parts) : NULL);
#pragma omp barrier
}

/* While one thread does a layer's input norm, the others ask for more of their qkv share than the previous
   product's end asked for. */
static void prefetch_share(const StepLinear *l, int part, int parts) {
    int64_t t0, t1;
    share_of(l, part, parts, &t0, &t1);
    const char *p = (const char *)l->weight + t0 * l->tile_bytes;
    const int64_t share = (t1 - t0) * l->tile_bytes, bytes = share < TEAM_PREFETCH ? share : TEAM_PREFETCH;
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
}

static void decode_layers_team(const StepModel *m, const StepBuffers *b, const int64_t *positions,
                               const int64_t *slots, const int32_t *block_tables, int64_t ldt,
                               const int32_t *seq_lens) {
    const int H = m->heads, KV = m->kv_heads, D = m->head_dim, dt = m->dt;
    const int64_t E = m->hidden, width = (int64_t)(H + 2 * KV) * D;
    if (attention_path < 0) kvg_select_attention_path(ATTENTION_AVX512_BF16);
    const int most_chunks = (seq_lens[0] + MIN_CHUNK - 1) / MIN_CHUNK; /* at any layer's window */
    float *parts = malloc(sizeof(float) * most_chunks * H * (D + 2));
#pragma omp parallel num_threads(num_threads)
    {
        const int part = omp_get_thread_num(), parts_n = omp_get_num_threads();
        float *qf = malloc(sizeof(float) * attention_scratch(H, D));
        for (int i = 0; i < m->num_layers; i++) {
            const StepLayer *layer = m->layers + i, *next = i + 1 < m->num_layers ? layer + 1 : NULL;
            if (part == 0)
                kvg_rms_norm(b->hidden, layer->input_norm, b->normed, 1, E, m->eps, dt);
            else
                prefetch_share(&layer->qkv, part, parts_n);
#pragma omp barrier
            team_linear(m, &layer->qkv, &layer->o, b->normed, b->qkv, 0, part, parts_n);
            if (part == 0)
                kvg_rope_write_kv(b->qkv, width, m->cos, m->sin, positions, slots, layer->k_cache, layer->v_cache, 1,
                                  H, KV, D, dt);
#pragma omp barrier
            const AttentionSplit split = attention_split(seq_lens, 1, layer->window);
#pragma omp for schedule(dynamic, 1)
            for (int c = 0; c < split.chunks; c++)
                attention_task(0, c, split, b->qkv, width, layer->k_cache, layer->v_cache, block_tables, ldt,
                               seq_lens, H, KV, D, m->block_size, m->scale, dt, layer->window,
                               parts + (int64_t)c * H * (D + 2), qf);
            if (part == 0)
                for (int head = 0; head < H; head++)
                    attention_merge(0, head, split.chunks, parts, b->attn, (int64_t)H * D, H, D, dt);
#pragma omp barrier
            team_linear(m, &layer->o, &layer->gate_up, b->attn, b->hidden, 1, part, parts_n);
            if (part == 0)
                kvg_rms_norm(b->hidden, layer->post_norm, b->normed, 1, E, m->eps, dt);
#pragma omp barrier
            team_linear(m, &layer->gate_up, &layer->down, b->normed, b->gate_up, 0, part, parts_n);
            if (part == 0)
                kvg_silu_mul(b->gate_up, b->act, 1, m->intermediate, dt);
#pragma omp barrier
            team_linear(m, &layer->down, next ? &next->qkv : NULL, b->act, b->hidden, 1, part, parts_n);
        }
        free(qf);
    }
    free(parts);
}

/*
 * Gemma 3's layers (models/gemma3.py, op for op): four norms a layer, each of the attention's and the MLP's
 * outputs normed before it joins the residual stream; the q and k heads normed before the rotary, each layer's
 * own rotary tables; GELU (tanh) for SiLU. The products' outputs go to `normed` (free by then), are normed in
 * place and added to `hidden`.
 */
static void decode_layers_gemma(const StepModel *m, const StepBuffers *b, int rows, const int64_t *positions,
                                const int64_t *slots, const int32_t *block_tables, int64_t ldt,
                                const int32_t *seq_lens) {
    const int H = m->heads, KV = m->kv_heads, D = m->head_dim, dt = m->dt, es = dt == BF16 ? 2 : 4;
    const int64_t E = m->hidden, width = (int64_t)(H + 2 * KV) * D;
    for (int i = 0; i < m->num_layers; i++) {
        const StepLayer *layer = m->layers + i;
        kvg_rms_norm_scaled(b->hidden, layer->input_norm, b->normed, rows, E, m->eps, dt);
        step_linear(m, &layer->qkv, b->normed, b->qkv, width, rows, 0);
        for (int r = 0; r < rows; r++) {
            char *q = (char *)b->qkv + r * width * es;
            kvg_rms_norm_scaled(q, layer->q_norm, q, H, D, m->eps, dt);
            kvg_rms_norm_scaled(q + (int64_t)H * D * es, layer->k_norm, q + (int64_t)H * D * es, KV, D, m->eps, dt);
        }
        kvg_rope_write_kv(b->qkv, width, layer->cos, layer->sin, positions, slots, layer->k_cache, layer->v_cache,
                          rows, H, KV, D, dt);
        kvg_decode_attention(b->qkv, width, layer->k_cache, layer->v_cache, block_tables, ldt, seq_lens, b->attn,
                             (int64_t)H * D, rows, H, KV, D, m->block_size, m->scale, dt, layer->window);
        step_linear(m, &layer->o, b->attn, b->normed, E, rows, 0);
        kvg_rms_norm_scaled(b->normed, layer->post_norm, b->normed, rows, E, m->eps, dt);
        kvg_add(b->hidden, b->normed, rows * E, dt);
        kvg_rms_norm_scaled(b->hidden, layer->pre_ffn_norm, b->normed, rows, E, m->eps, dt);
        step_linear(m, &layer->gate_up, b->normed, b->gate_up, 2 * m->intermediate, rows, 0);
        kvg_gelu_tanh_mul(b->gate_up, b->act, rows, m->intermediate, dt);
        step_linear(m, &layer->down, b->act, b->normed, E, rows, 0);
        kvg_rms_norm_scaled(b->normed, layer->post_ffn_norm, b->normed, rows, E, m->eps, dt);
        kvg_add(b->hidden, b->normed, rows * E, dt);
    }
}

void kvg_decode_layers(const StepModel *m, const StepBuffers *b, int rows, const int64_t *positions,
                       const int64_t *slots, const int32_t *block_tables, int64_t ldt, const int32_t *seq_lens) {
    if (m->gemma) {
        decode_layers_gemma(m, b, rows, positions, slots, block_tables, ldt, seq_lens);
        return;
    }
    if (m->team && rows == 1 && num_threads > 1) {
        decode_layers_team(m, b, positions, slots, block_tables, ldt, seq_lens);
        return;
    }
    const int H = m->heads, KV = m->kv_heads, D = m->head_dim;
    const int64_t E = m->hidden, width = (int64_t)(H + 2 * KV) * D;
    for (int i = 0; i < m->num_layers; i++) {
        const StepLayer *layer = m->layers + i;
        kvg_rms_norm(b->hidden, layer->input_norm, b->normed, rows, E, m->eps, m->dt);
        step_linear(m, &layer->qkv, b->normed, b->qkv, width, rows, 0);
        kvg_rope_write_kv(b->qkv, width, m->cos, m->sin, positions, slots, layer->k_cache, layer->v_cache, rows, H,
                          KV, D, m->dt);
        kvg_decode_attention(b->qkv, width, layer->k_cache, layer->v_cache, block_tables, ldt, seq_lens, b->attn,
                             (int64_t)H * D, rows, H, KV, D, m->block_size, m->scale, m->dt, layer->window);
        step_linear(m, &layer->o, b->attn, b->hidden, E, rows, 1);
        kvg_rms_norm(b->hidden, layer->post_norm, b->normed, rows, E, m->eps, m->dt);
        step_linear(m, &layer->gate_up, b->normed, b->gate_up, 2 * m->intermediate, rows, 0);
        kvg_silu_mul(b->gate_up, b->act, rows, m->intermediate, m->dt);
        step_linear(m, &layer->down, b->act, b->hidden, E, rows, 1);
    }
}
