//! The operations of the IR and their shape rules.

use crate::{DType, Dim, Shape, Sym};

/// Run-time inputs of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum InputKind {
    /// `i32[tokens]`: the new tokens.
    TokenIds,
    /// `i32[tokens]`: their absolute positions in the sequence.
    Positions,
    /// `f32[tokens, width]`: another model's hidden state at each token (a multi-token
    /// prediction head reads its target's, `Graph::hidden_states_input`).
    HiddenStates,
}

impl InputKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::TokenIds => "token_ids",
            Self::Positions => "positions",
            Self::HiddenStates => "hidden_states",
        }
    }
}

/// How rotary pairs are laid out inside a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum RopeLayout {
    /// HF/NEOX: element i pairs with i + rotary_dim/2.
    RotateHalf,
    /// GPT-J / llama.cpp's permuted GGUF Llama weights: element 2i pairs with 2i+1.
    AdjacentPairs,
    /// HF's proportional RoPE (Gemma 4's full-attention layers): element i pairs with
    /// i + head_dim/2 as in `RotateHalf`, but only the first `rotary_dim / 2` pairs turn, at
    /// frequencies `θ^(−2i/head_dim)` spaced over the whole head; the others stay.
    Proportional,
}

/// How RoPE's frequencies are rescaled for contexts longer than the model was trained at (on
/// top of `RopeSpec::position_scale`, linear scaling).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub enum RopeScaling {
    #[default]
    None,
    /// Llama 3.1's (`rope_type` "llama3"): a frequency whose wavelength is over
    /// `original_context / low_freq_factor` is divided by `factor`, one under
    /// `original_context / high_freq_factor` kept, and one between blended linearly in
    /// `original_context / wavelength`.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_context: f64,
    },
    /// YaRN (`rope_type` "yarn", as transformers computes it): pair `i`'s frequency blended
    /// between itself (extrapolated: the fast pairs) and itself divided by `factor`
    /// (interpolated: the slow ones), linearly in `i` between the pairs that turn `beta_fast`
    /// and `beta_slow` times over `original_context` positions (those bounds rounded outward
    /// where `truncate`); cos and sin are multiplied by `attention_factor`.
    Yarn {
        factor: f64,
        original_context: f64,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// Pair `pair`'s inverse frequency, `inv_freq` unscaled (`1 / θ^(2·pair/dims)`, in f32 as
    /// HF computes it), rescaled.
    pub fn rescale(&self, pair: usize, inv_freq: f32, dims: usize, theta: f64) -> f32 {
        match *self {
            Self::None => inv_freq,
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => {
                let f = inv_freq as f64;
                let wavelength = 2.0 * std::f64::consts::PI / f;
                let divisor = if wavelength < original_context / high_freq_factor {
                    1.0
                } else if wavelength > original_context / low_freq_factor {
                    factor
                } else {
                    let smooth =
                        (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                (f / divisor) as f32
            }
            Self::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // The pair index that turns `rotations` times over the original context.
                let pair_turning = |rotations: f64| {
                    dims as f64 * (original_context / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (pair_turning(beta_fast), pair_turning(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dims as f64 - 1.0));
                if low == high {
                    high += 0.001;
                }
                // In f32, as transformers: the ramp, and the two frequencies it blends.
                let pos_freq = 1.0 / inv_freq;
                let ramp = ((pair as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
                let extrapolated = 1.0 - ramp;
                let interpolated = 1.0 / (factor as f32 * pos_freq);
                interpolated * (1.0 - extrapolated) + inv_freq * extrapolated
            }
        }
    }

    /// What cos and sin are multiplied by (1 but for YaRN).
    pub fn attention_factor(&self) -> f32 {
        match *self {
            Self::Yarn { attention_factor, .. } => attention_factor as f32,
            Self::None | Self::Llama3 { .. } => 1.0,
        }
    }

    /// How the IR text, plan constants and caches built from it name it (empty for none; f64s
    /// print as the shortest text that reads back to the same bits, so the name is exact).
    pub fn describe(&self) -> String {
        match *self {
            Self::None => String::new(),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => format!("llama3(factor={factor}, low={low_freq_factor}, high={high_freq_factor}, context={original_context})"),
            Self::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            } => format!(
                "yarn(factor={factor}, context={original_context}, beta_fast={beta_fast}, beta_slow={beta_slow}, truncate={truncate}, attention_factor={attention_factor})"
            ),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RopeSpec {
    pub heads: usize,
    pub head_dim: usize,
    /// The first `rotary_dim` elements of each head rotate; the rest pass through.
    pub rotary_dim: usize,
    pub theta: f64,
    /// Linear position scaling (positions are divided by it); 1.0 for none.
    pub position_scale: f64,
    pub layout: RopeLayout,
    /// Frequencies rescaled by frequency (Llama 3.1's).
    #[serde(default)]
    pub scaling: RopeScaling,
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AttentionSpec {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k before the softmax.
    pub scale: f64,
    /// Sliding window: a query at position p sees keys at k with p − window < k ≤ p.
    pub window: Option<usize>,
    /// Which KV cache this attention appends to and reads (one per layer).
    pub cache_slot: usize,
    /// What the cache stores keys and values as: f32, or bf16 (a bf16 model's, as transformers
    /// and vLLM keep it: half the bytes a decode step reads and the cache holds). Keys and
    /// values are rounded to it when appended, on every backend alike.
    #[serde(default = "f32_cache")]
    pub cache_dtype: DType,
}

fn f32_cache() -> DType {
    DType::F32
}

/// A mixture-of-experts feed-forward layer: a router chooses `experts_per_token` of `experts`
/// gated-linear experts for each token and weighs their outputs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoeSpec {
    /// Routed experts (`n_routed_experts`, `num_experts`).
    pub experts: usize,
    /// Experts each token goes to (`num_experts_per_tok`).
    pub experts_per_token: usize,
    /// Divide the chosen experts' weights by their sum (`norm_topk_prob`).
    pub normalize: bool,
    /// Each expert's hidden width (`moe_intermediate_size`).
    pub intermediate: usize,
    pub act: GluAct,
    pub router: MoeRouter,
}

/// How a token's experts and their weights are chosen from the router's logits.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum MoeRouter {
    /// Qwen2-MoE / Qwen3-Next: a softmax over every expert, the `experts_per_token` largest.
    Softmax,
    /// DeepSeek-V3 / GLM-4.5: sigmoid scores and a per-expert score bias (an input of the op)
    /// that steers the choice but not the weights; experts fall in `groups` consecutive
    /// groups, a group scores the sum of its two best biased scores, and a token picks its
    /// experts inside the `top_groups` best groups (`n_group`, `topk_group`); the weights are
    /// multiplied by `scaling` (`routed_scaling_factor`).
    GroupedSigmoid {
        groups: usize,
        top_groups: usize,
        scaling: f32,
    },
    /// Gemma 4: `Softmax`'s choice and weights, each weight then multiplied by its expert's
    /// scale (`per_expert_scale`, an input of the op).
    SoftmaxExpertScale,
}

impl MoeSpec {
    /// Whether the op takes a vector of one value per expert as its third input: the grouped
    /// router's score bias, or the experts' scales.
    pub fn has_expert_vector(&self) -> bool {
        matches!(
            self.router,
            MoeRouter::GroupedSigmoid { .. } | MoeRouter::SoftmaxExpertScale
        )
    }
}

/// A Gated DeltaNet token mixer (Qwen3.5 / Qwen3-Next linear-attention layers): a causal
/// depthwise convolution over the joined q/k/v projection, then the gated delta rule, a
/// recurrence over an f32 state of `[key_dim, value_dim]` per value head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct DeltaNetSpec {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    /// The convolution's width (`linear_conv_kernel_dim`).
    pub conv_kernel: usize,
    /// Which recurrent state this layer keeps (one per layer, like an attention's cache slot).
    pub state_slot: usize,
    /// Which key head each value head reads (the weights' order of value heads).
    #[serde(default)]
    pub value_head_order: ValueHeadOrder,
    /// What the per-value-head decay-rate input holds.
    #[serde(default)]
    pub decay_rate: DecayRate,
}

/// How the value heads of a Gated DeltaNet share its key heads, `r = value_heads / key_heads`
/// value heads each: the order the value rows of the projections (and the columns of the
/// output projection) are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub enum ValueHeadOrder {
    /// HF's: a key head's `r` value heads together, value head `h` reading key head `h / r`.
    #[default]
    Grouped,
    /// llama.cpp's GGUF files (its converter reorders them so ggml can broadcast): value head
    /// `h` reads key head `h % key_heads`.
    Tiled,
}

/// How a Gated DeltaNet's decay rate `A < 0` (one per value head) is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub enum DecayRate {
    /// HF's `A_log`: `A = −exp(A_log)`.
    #[default]
    Log,
    /// `A` itself (llama.cpp's GGUF `ssm_a`, which its converter writes as `−exp(A_log)`).
    Value,
}

impl DeltaNetSpec {
    /// The key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        match self.value_head_order {
            ValueHeadOrder::Grouped => h / (self.value_heads / self.key_heads),
            ValueHeadOrder::Tiled => h % self.key_heads,
        }
    }

    /// Channels of the joined projection and of the convolution: `[q | k | v]`.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// f32 values of one sequence's state: the convolution's last `conv_kernel − 1` inputs per
    /// channel, then the delta rule's `[value_heads, key_dim, value_dim]`.
    pub fn state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_channels() + self.value_heads * self.key_dim * self.value_dim
    }
}

/// Multi-head latent attention with DeepSeek's sparse indexer (GLM-5, DeepSeek-V3.2): each
/// head scores a key by `q_nope·k_nope + q_pe·k_pe` (the rotary part `k_pe` shared by every
/// head), but only over the `index_topk` earlier positions a light indexer ranks highest.
///
/// Inputs: `q_nope [t, heads·nope]`, `q_pe [t, heads·rope]`, the normed key/value latent
/// `c [t, latent]`, `k_pe [t, rope]`, the up-projections `k_b` (weight `[heads·latent, nope]`:
/// each head's `W_UKᵀ`, as llama.cpp stores `attn_k_b`) and `v_b` (`[heads·value, latent]`:
/// each head's `W_UV`), the indexer's queries `[t, index_heads·index_dim]` and weights
/// `[t, index_heads]`, and, where the layer has its own indexer, its key `[t, index_dim]`. A
/// head's key is `[W_UK·c | k_pe]` and its value `W_UV·c`, but the cache keeps `c` itself
/// (DeepSeek's latent cache): `[c | k_pe | index key]`, `latent + rope + index_dim` values a
/// position where the expanded keys and values would take `heads·(nope + value) + rope`.
///
/// A layer without an indexer of its own (GLM-5.2's "shared" layers) keeps the positions the
/// previous full layer keeps: its queries and weights are that layer's, and so are the index
/// keys, read from that layer's cache (`index_slot`); its own rows are `[c | k_pe]`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SparseMlaSpec {
    pub heads: usize,
    /// Per head: the query/key dims without RoPE (`qk_nope_head_dim`), with RoPE
    /// (`qk_rope_head_dim`), and the value dims (`v_head_dim`).
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub value_dim: usize,
    /// The key/value latent's width (`kv_lora_rank`).
    pub latent_dim: usize,
    /// Multiplies the query-key score before the softmax (`(nope + rope)^−½`).
    pub scale: f64,
    /// The indexer: its heads (`index_n_heads`), their width (`index_head_dim`, also its one
    /// key's), and how many positions a query keeps (`index_topk`).
    pub index_heads: usize,
    pub index_dim: usize,
    pub index_topk: usize,
    /// Which cache this attention appends to and reads (one per layer).
    pub cache_slot: usize,
    /// Which cache holds the index keys it ranks positions by: `cache_slot` where the layer has
    /// its own indexer, else the full layer's whose choice it shares.
    pub index_slot: usize,
}

impl SparseMlaSpec {
    /// Whether the layer ranks positions with an indexer of its own (and caches its keys).
    pub fn has_own_indexer(&self) -> bool {
        self.index_slot == self.cache_slot
    }

    /// A cached position's row: `[c (latent) | k_pe (rope) | index key (index_dim)]`, without
    /// the index key where the layer shares another's indexer.
    pub fn cache_width(&self) -> usize {
        let index = if self.has_own_indexer() { self.index_dim } else { 0 };
        self.latent_dim + self.rope_dim + index
    }

    /// Inputs: 8, and the index keys where the layer has its own indexer.
    pub fn arity(&self) -> usize {
        8 + usize::from(self.has_own_indexer())
    }

    /// Where a cached row's index key starts.
    pub fn index_key_offset(&self) -> usize {
        self.latent_dim + self.rope_dim
    }

    /// The output's width: every head's values.
    pub fn out_width(&self) -> usize {
        self.heads * self.value_dim
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Op {
    Input(InputKind),
    /// A named model weight; its shape and storage dtype are the node's.
    Weight {
        name: String,
    },
    /// `(table [vocab, d], ids i32[t]) -> [t, d]`.
    Embedding,
    /// `(x [t, k], w [n, k]) -> [t, n]`, i.e. `x · wᵀ` as every linear layer stores `w`.
    MatMul,
    /// RMSNorm over consecutive groups of `group` elements of the last dim:
    /// `x · rsqrt(mean(x²) + eps) · (w + weight_offset)`; `w` has `group` elements.
    RmsNorm {
        eps: f64,
        weight_offset: f32,
        group: usize,
    },
    /// `(x [t, heads·head_dim], positions i32[t])`: rotary position embedding.
    Rope(RopeSpec),
    /// `(q [t, heads·hd], k [t, kv_heads·hd], v [t, kv_heads·hd]) -> [t, heads·hd]`: appends
    /// k, v to the cache slot, then causal softmax attention over everything cached.
    Attention(AttentionSpec),
    /// `(q [t, heads·hd], k [t, kv_heads·hd], v [t, kv_heads·hd], positions i32[t]) ->
    /// [t, heads·hd]`: `Attention(rope(q), rope(k), v)`, q and k rotated as the step's
    /// keys are appended (one pass over the new rows where there were two). `rope` is the
    /// rotation of every head of `[q | k]`: its `heads` is `heads + kv_heads`.
    RopeAttention {
        rope: RopeSpec,
        attention: AttentionSpec,
    },
    /// `q [t, heads·hd] -> [t, heads·hd]`: causal softmax attention over the cache slot as
    /// an earlier `attention` of the same step left it, appending nothing: Gemma 4's KV-shared
    /// layers attend over the keys and values of the last earlier layer of their kind.
    SharedKvAttention(AttentionSpec),
    Add,
    Mul,
    /// Multiply by a constant.
    Scale {
        factor: f32,
    },
    /// `x · sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation (PyTorch's `gelu(approximate="tanh")`).
    GeluTanh,
    /// `[t, d] -> [1, d]`: the last row (logits are only needed for the last token).
    LastToken,
    /// `(x [t, n], b [n]) -> [t, n]`: a linear layer's bias, added to every row.
    AddBias,
    /// `(x [t, n], order i32[n]) -> [t, n]`: column `j` of each row is `x`'s column
    /// `order[j]` (`order` a permutation, a weight): the input of a linear layer whose weight's
    /// columns are held in that order (a GPTQ act-order checkpoint's, its groups made whole).
    PermuteColumns,
    /// `1 / (1 + e^−x)` per element.
    Sigmoid,
    /// `cap · tanh(x / cap)` per element: Gemma's soft-capping of the final logits.
    SoftCap {
        cap: f32,
    },
    /// `(x [t, n], s) -> [t, n]`: each row times a scalar, its own (`s [t, 1]`: Qwen3-Next's
    /// gated shared expert) or one for all (`s [1]`, a weight: Gemma 4's `layer_scalar`).
    ScaleRows,
    /// `(x [t, n], w [n], b [n]) -> [t, n]`: LayerNorm of every row, `(x − mean) · rsqrt(var +
    /// eps) · w + b` (GLM-5's indexer keys).
    LayerNorm {
        eps: f64,
    },
    /// `(q_nope [t, h·n], q_pe [t, h·r], c [t, l], k_pe [t, r], k_b [h·l, n], v_b [h·v, l],
    /// index_q [t, ih·id], index_weights [t, ih], index_k [t, id] where the layer has its own
    /// indexer) -> [t, h·v]`: appends the step's latents, rotary keys and index keys to the
    /// cache slot (keys and values come from the latents through `k_b` and `v_b`:
    /// `SparseMlaSpec`), then for each query at position p ranks
    /// the cached positions ≤ p by `Σ_i index_weights[i] · ih^−½ · id^−½ · relu(index_q_i ·
    /// index_k)`, keeps the `index_topk` best (all of them while there are no more; among
    /// equal scores the earlier position), and attends over those (q and k rotated already).
    SparseMla(SparseMlaSpec),
    /// RMSNorm over consecutive groups of `group` elements without a weight:
    /// `x · rsqrt(mean(x²) + eps)` (Gemma 4's values).
    UnitRmsNorm {
        eps: f64,
        group: usize,
    },
    /// `[t, g·group] -> [t, g·len]`: columns `start..start+len` of every group of `group`
    /// columns (one part of per-head interleaved projections, such as Qwen3.5's `[q | gate]`).
    GroupSlice {
        group: usize,
        start: usize,
        len: usize,
    },
    /// `(mixed [t, c], b [t, vh], a [t, vh], conv [c, kernel], a_log [vh], dt_bias [vh]) ->
    /// [t, vh·dv]` with `c = 2·kh·dk + vh·dv`: `mixed` through the causal convolution (whose
    /// window reaches into the sequence's earlier tokens) and SiLU, split into q, k (`kh`
    /// heads of `dk`) and v (`vh` heads of `dv`); q and k L2-normalised, q scaled by `dk^−½`;
    /// each value head `h` (reading key head `h / (vh / kh)`) decays its state by
    /// `exp(−e^{a_log} · softplus(a + dt_bias))`, writes `sigmoid(b)·(v − Sᵀk)` along `k`, and
    /// reads `Sᵀq`. Tokens are taken in order; the state persists across steps.
    GatedDeltaNet(DeltaNetSpec),
    /// `(x [t, d], router_logits [t, experts], [score_bias [experts],] gate_up
    /// [experts·2i, d], down [experts·d, i]) -> [t, d]`: the routed experts' weighted sum (the
    /// score bias only for routers that have one). Expert `e`'s gate and up rows are rows
    /// `e·2i..(e+1)·2i` of `gate_up` (gate first), its down projection rows `e·d..(e+1)·d` of
    /// `down`; shared experts are ordinary MLPs beside it.
    Moe(MoeSpec),

    // Ops that rewrites produce (see the `passes` crate).
    /// `[t, n] -> [t, len]`: columns `start..start+len` (a view of a fused op's output).
    Slice {
        start: usize,
        len: usize,
    },
    /// `(a [t, m], b [t, n]) -> [t, m + n]`: each row of `a` followed by the same row of `b`
    /// (a multi-token prediction head joins a token's embedding and a hidden state).
    ConcatColumns,
    /// Weights `[n_i, k]` of one storage dtype stacked to `[Σn_i, k]`: a compile-time weight
    /// transform, so one matmul computes several projections of the same activation.
    ConcatRows,
    /// A weight `[g·group, k] -> [g·len, k]`: rows `start..start+len` of every group of `group`
    /// rows, a compile-time weight transform (Qwen3-Next stores its DeltaNet projections
    /// interleaved per key head; this regroups them as q, k, v, z).
    RowGroupSlice {
        group: usize,
        start: usize,
        len: usize,
    },
    /// A weight `[g·group, k] -> [g·k, len]`: rows `start..start+len` of every group of `group`
    /// rows, each group's `[len, k]` block transposed, a compile-time weight transform (GLM-5's
    /// `kv_b_proj` holds each head's `W_UK` as `[nope, latent]`; latent attention reads it as
    /// `[latent, nope]`, as llama.cpp's files store it).
    TransposeRowGroups {
        group: usize,
        start: usize,
        len: usize,
    },
    /// `(a [t, d], b [t, d], w [d]) -> [t, 2d]`: `[a + b | rms_norm(a + b)]` in one pass.
    AddRmsNorm {
        eps: f64,
        weight_offset: f32,
    },
    /// `(x [t, d], w [d], W [n, d]) -> [t, n]`: `rms_norm(x) · Wᵀ` with the norm as the
    /// matmul's prologue.
    RmsNormMatMul {
        eps: f64,
        weight_offset: f32,
    },
    /// `(a [t, d], b [t, d], w [d], W [n, d]) -> [t, d + n]`: `[a + b | rms_norm(a + b) · Wᵀ]`,
    /// the residual add and the norm as the matmul's prologue, the sum written once beside it.
    /// With `glu` (W a joined gate/up, n even) the product's halves meet in its epilogue:
    /// `[t, d + n/2]`, `[a + b | act(y[:, :n/2]) · y[:, n/2:]]`.
    AddRmsNormMatMul {
        eps: f64,
        weight_offset: f32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        glu: Option<GluAct>,
    },
    /// `x [t, 2n] -> [t, n]`: `act(x[:, :n]) · x[:, n:]` (SwiGLU, GeGLU on joined gate/up).
    Glu {
        act: GluAct,
    },
    /// Inputs of one shape combined per element by an expression tree.
    Elementwise {
        expr: crate::Expr,
    },
    /// `x [t, v] -> i32[t, k]`: indices of the k largest values, largest first, ties to the
    /// lowest index (argmax is k = 1).
    TopK {
        k: usize,
    },
    /// `(h [t, d], W [v, d]) -> i32[t, k]`: exactly `TopK(h · Wᵀ)` (of `SoftCap(h · Wᵀ)`
    /// where the logits are soft-capped), computed by an INT8 pass with per-row error bounds
    /// and a full-precision rescoring of the candidates only.
    Int8BoundTopK {
        k: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        soft_cap: Option<f32>,
    },
    /// `(h [t, d], W [v, d]) -> i32[t, k]`: a draft head's top k, approximately: the
    /// `candidates` rows of `W` scoring highest under a 4-bit copy of `W` (blocks of 32 along
    /// each row, one scale a block), rescored in `W`'s own precision, and their k best (ties to
    /// the lowest id). Exactly `TopK(h · Wᵀ)` wherever those k are among the candidates: for
    /// drafters, whose guesses the target verifies.
    ShortlistTopK {
        k: usize,
        candidates: usize,
    },
}

/// The activation of a gated linear unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum GluAct {
    Silu,
    GeluTanh,
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Input(_) => "input",
            Self::Weight { .. } => "weight",
            Self::Embedding => "embedding",
            Self::MatMul => "matmul",
            Self::RmsNorm { .. } => "rms_norm",
            Self::Rope(_) => "rope",
            Self::Attention(_) => "attention",
            Self::RopeAttention { .. } => "rope_attention",
            Self::SharedKvAttention(_) => "shared_kv_attention",
            Self::Add => "add",
            Self::Mul => "mul",
            Self::Scale { .. } => "scale",
            Self::Silu => "silu",
            Self::GeluTanh => "gelu_tanh",
            Self::LastToken => "last_token",
            Self::AddBias => "add_bias",
            Self::PermuteColumns => "permute_columns",
            Self::Sigmoid => "sigmoid",
            Self::SoftCap { .. } => "soft_cap",
            Self::ScaleRows => "scale_rows",
            Self::UnitRmsNorm { .. } => "unit_rms_norm",
            Self::LayerNorm { .. } => "layer_norm",
            Self::SparseMla(_) => "sparse_mla",
            Self::GroupSlice { .. } => "group_slice",
            Self::GatedDeltaNet(_) => "gated_delta_net",
            Self::Moe(_) => "moe",
            Self::Slice { .. } => "slice",
            Self::ConcatRows => "concat_rows",
            Self::ConcatColumns => "concat_columns",
            Self::RowGroupSlice { .. } => "row_group_slice",
            Self::TransposeRowGroups { .. } => "transpose_row_groups",
            Self::AddRmsNorm { .. } => "add_rms_norm",
            Self::RmsNormMatMul { .. } => "rms_norm_matmul",
            Self::AddRmsNormMatMul { .. } => "add_rms_norm_matmul",
            Self::Glu { act: GluAct::Silu } => "swiglu",
            Self::Glu { act: GluAct::GeluTanh } => "geglu",
            Self::Elementwise { .. } => "elementwise",
            Self::TopK { .. } => "top_k",
            Self::Int8BoundTopK { .. } => "int8_bound_top_k",
            Self::ShortlistTopK { .. } => "shortlist_top_k",
        }
    }

    /// The attention this op runs over its KV cache slot, fused or not, appending the step's
    /// keys and values first or (`shared_kv_attention`) reading another layer's.
    pub fn attention(&self) -> Option<&AttentionSpec> {
        match self {
            Self::Attention(spec) | Self::RopeAttention { attention: spec, .. } | Self::SharedKvAttention(spec) => {
                Some(spec)
            }
            _ => None,
        }
    }

    /// The attention whose KV cache slot this op appends to: a slot of its own, which the
    /// layers sharing it (`shared_kv_attention`) only read.
    pub fn appended_attention(&self) -> Option<&AttentionSpec> {
        match self {
            Self::SharedKvAttention(_) => None,
            op => op.attention(),
        }
    }

    /// Ops that reshape weights at compile time (`concat_rows`, `row_group_slice`,
    /// `transpose_row_groups`): their results are weights, made once where weights are laid
    /// out.
    pub fn is_weight_transform(&self) -> bool {
        matches!(
            self,
            Self::ConcatRows | Self::RowGroupSlice { .. } | Self::TransposeRowGroups { .. }
        )
    }

    /// Ops that combine values element by element (fusable into one `Elementwise`).
    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Self::Add
                | Self::Mul
                | Self::Scale { .. }
                | Self::Silu
                | Self::GeluTanh
                | Self::SoftCap { .. }
                | Self::Elementwise { .. }
        )
    }

    /// Number of inputs; `None` for variadic ops (`ConcatRows`, `Elementwise`).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Self::Input(_) | Self::Weight { .. } => 0,
            Self::Scale { .. } | Self::Silu | Self::GeluTanh | Self::LastToken => 1,
            Self::Sigmoid | Self::GroupSlice { .. } | Self::RowGroupSlice { .. } | Self::UnitRmsNorm { .. } => 1,
            Self::TransposeRowGroups { .. } => 1,
            Self::SoftCap { .. } | Self::SharedKvAttention(_) => 1,
            Self::GatedDeltaNet(_) => 6,
            Self::Slice { .. } | Self::Glu { .. } | Self::TopK { .. } => 1,
            Self::Embedding | Self::MatMul | Self::RmsNorm { .. } | Self::Rope(_) | Self::Add | Self::Mul => 2,
            Self::AddBias | Self::ScaleRows | Self::ConcatColumns | Self::PermuteColumns => 2,
            Self::LayerNorm { .. } => 3,
            Self::SparseMla(spec) => spec.arity(),
            Self::Moe(spec) if spec.has_expert_vector() => 5,
            Self::Moe(_) => 4,
            Self::Int8BoundTopK { .. } | Self::ShortlistTopK { .. } => 2,
            Self::Attention(_) | Self::AddRmsNorm { .. } | Self::RmsNormMatMul { .. } => 3,
            Self::AddRmsNormMatMul { .. } | Self::RopeAttention { .. } => 4,
            Self::ConcatRows | Self::Elementwise { .. } => return None,
        })
    }

    /// The output shape and dtype from the inputs', or why the inputs do not fit.
    pub fn infer(&self, inputs: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
        if let Some(arity) = self.arity() {
            if inputs.len() != arity {
                return Err(format!("{} takes {arity} inputs, got {}", self.name(), inputs.len()));
            }
        }
        let f32_rows = |s: &Shape| -> Result<(Dim, Dim), String> {
            match s.0.as_slice() {
                [r, c] => Ok((*r, *c)),
                _ => Err(format!("{} expects a matrix, got {s}", self.name())),
            }
        };
        let tokens_vec = |s: &Shape, d: DType, what: &str| -> Result<Dim, String> {
            match (s.0.as_slice(), d) {
                ([t], DType::I32) => Ok(*t),
                _ => Err(format!("{}: {what} must be i32[tokens], got {d}{s}", self.name())),
            }
        };
        match self {
            Self::Input(_) => Err("inputs are created by Graph::input".into()),
            Self::Weight { .. } => Err("weights are created by Graph::weight".into()),
            Self::Embedding => {
                let (_, d) = f32_rows(inputs[0].0)?;
                let t = tokens_vec(inputs[1].0, inputs[1].1, "ids")?;
                Ok((Shape::new([t, d]), DType::F32))
            }
            Self::MatMul => {
                let (t, k) = f32_rows(inputs[0].0)?;
                let (n, wk) = f32_rows(inputs[1].0)?;
                if k != wk {
                    return Err(format!("matmul: x is {} but w is {}", inputs[0].0, inputs[1].0));
                }
                Ok((Shape::new([t, n]), DType::F32))
            }
            Self::RmsNorm { group, .. } => {
                let (t, d) = f32_rows(inputs[0].0)?;
                let w = inputs[1].0;
                let ok_group = *group > 0 && d.as_const().is_some_and(|d| d % group == 0);
                if !ok_group || w.0.as_slice() != [Dim::Const(*group)] {
                    return Err(format!("rms_norm: x {} with group {group} and weight {w}", inputs[0].0));
                }
                Ok((Shape::new([t, d]), DType::F32))
            }
            Self::Rope(spec) => {
                let (t, d) = f32_rows(inputs[0].0)?;
                tokens_vec(inputs[1].0, inputs[1].1, "positions")?;
                let fits = d == Dim::Const(spec.heads * spec.head_dim)
                    && spec.rotary_dim <= spec.head_dim
                    && spec.rotary_dim % 2 == 0;
                if !fits {
                    return Err(format!("rope: x {} does not fit {spec:?}", inputs[0].0));
                }
                Ok((Shape::new([t, d]), DType::F32))
            }
            Self::Attention(spec) => attention_shape(spec, inputs),
            // The keys and values are the cache's: the query stands in for their row count.
            Self::SharedKvAttention(spec) => {
                let (t, _) = f32_rows(inputs[0].0)?;
                let kv = Shape::new([t, Dim::Const(spec.kv_heads * spec.head_dim)]);
                attention_shape(spec, &[inputs[0], (&kv, DType::F32), (&kv, DType::F32)])
            }
            Self::RopeAttention { rope, attention } => {
                tokens_vec(inputs[3].0, inputs[3].1, "positions")?;
                let fits = rope.heads == attention.heads + attention.kv_heads
                    && rope.head_dim == attention.head_dim
                    && rope.rotary_dim <= rope.head_dim
                    && rope.rotary_dim % 2 == 0;
                if !fits {
                    return Err(format!("rope_attention: {rope:?} does not rotate {attention:?}"));
                }
                attention_shape(attention, &inputs[..3])
            }
            Self::Add | Self::Mul => {
                if inputs[0].0 != inputs[1].0 {
                    return Err(format!(
                        "{}: shapes {} and {} differ",
                        self.name(),
                        inputs[0].0,
                        inputs[1].0
                    ));
                }
                Ok((inputs[0].0.clone(), DType::F32))
            }
            Self::Scale { .. } | Self::Silu | Self::GeluTanh => Ok((inputs[0].0.clone(), DType::F32)),
            // The step's positions too, for what runs on the last rows only.
            Self::LastToken if inputs[0].1 == DType::I32 => {
                tokens_vec(inputs[0].0, inputs[0].1, "positions")?;
                Ok((Shape::new([Dim::Const(1)]), DType::I32))
            }
            Self::LastToken => {
                let (_, d) = f32_rows(inputs[0].0)?;
                Ok((Shape::new([Dim::Const(1), d]), DType::F32))
            }
            Self::AddBias => {
                let (t, n) = f32_rows(inputs[0].0)?;
                if inputs[1].0 .0.as_slice() != [n] {
                    return Err(format!("add_bias: x {} with bias {}", inputs[0].0, inputs[1].0));
                }
                Ok((Shape::new([t, n]), DType::F32))
            }
            Self::Moe(spec) => moe_shape(spec, inputs),
            Self::Sigmoid | Self::SoftCap { .. } => {
                f32_rows(inputs[0].0)?;
                Ok((inputs[0].0.clone(), DType::F32))
            }
            Self::LayerNorm { .. } => {
                let (t, n) = f32_rows(inputs[0].0)?;
                if inputs[1].0 .0.as_slice() != [n] || inputs[2].0 .0.as_slice() != [n] {
                    return Err(format!(
                        "layer_norm: x {} with weight {} and bias {}",
                        inputs[0].0, inputs[1].0, inputs[2].0
                    ));
                }
                Ok((Shape::new([t, n]), DType::F32))
            }
            Self::SparseMla(spec) => sparse_mla_shape(spec, inputs),
            Self::UnitRmsNorm { group, .. } => {
                let (t, d) = f32_rows(inputs[0].0)?;
                if *group == 0 || d.as_const().is_none_or(|d| d % group != 0) {
                    return Err(format!("unit_rms_norm: x {} with group {group}", inputs[0].0));
                }
                Ok((Shape::new([t, d]), DType::F32))
            }
            Self::PermuteColumns => {
                let (t, n) = f32_rows(inputs[0].0)?;
                match (inputs[1].0 .0.as_slice(), inputs[1].1) {
                    ([len], DType::I32) if *len == n => Ok((Shape::new([t, n]), DType::F32)),
                    _ => Err(format!(
                        "permute_columns: x {} with an order {}{}, not i32[{n}]",
                        inputs[0].0, inputs[1].1, inputs[1].0
                    )),
                }
            }
            Self::ScaleRows => {
                let (t, _) = f32_rows(inputs[0].0)?;
                let s = inputs[1].0 .0.as_slice();
                if s != [t, Dim::Const(1)] && s != [Dim::Const(1)] {
                    return Err(format!("scale_rows: x {} with scalars {}", inputs[0].0, inputs[1].0));
                }
                Ok((inputs[0].0.clone(), DType::F32))
            }
            Self::GroupSlice { group, start, len } => {
                let (t, n) = f32_rows(inputs[0].0)?;
                let groups = n.as_const().filter(|n| *group > 0 && n % group == 0).map(|n| n / group);
                match groups {
                    Some(g) if *len > 0 && start + len <= *group => {
                        Ok((Shape::new([t, Dim::Const(g * len)]), DType::F32))
                    }
                    _ => Err(format!(
                        "group_slice {start}..{} of groups of {group} in {}",
                        start + len,
                        inputs[0].0
                    )),
                }
            }
            Self::GatedDeltaNet(spec) => delta_net_shape(spec, inputs),
            Self::TransposeRowGroups { group, start, len } => {
                let (n, k) = f32_rows(inputs[0].0)?;
                let groups = n.as_const().filter(|n| *group > 0 && n % group == 0).map(|n| n / group);
                // Blocks hold a row's run of weights, so transposed they are no blocks:
                // block-quantized rows transpose into f32 (float rows keep their type).
                let dtype = match inputs[0].1 {
                    quantized if quantized.is_quantized() => DType::F32,
                    float => float,
                };
                match (groups, k.as_const()) {
                    (Some(g), Some(k)) if *len > 0 && start + len <= *group => {
                        Ok((Shape::new([Dim::Const(g * k), Dim::Const(*len)]), dtype))
                    }
                    _ => Err(format!(
                        "transpose_row_groups {start}..{} of groups of {group} in {}",
                        start + len,
                        inputs[0].0
                    )),
                }
            }
            Self::RowGroupSlice { group, start, len } => {
                let (n, k) = f32_rows(inputs[0].0)?;
                let groups = n.as_const().filter(|n| *group > 0 && n % group == 0).map(|n| n / group);
                match groups {
                    Some(g) if *len > 0 && start + len <= *group => {
                        Ok((Shape::new([Dim::Const(g * len), k]), inputs[0].1))
                    }
                    _ => Err(format!(
                        "row_group_slice {start}..{} of groups of {group} in {}",
                        start + len,
                        inputs[0].0
                    )),
                }
            }
            Self::Slice { start, len } => {
                let (t, n) = f32_rows(inputs[0].0)?;
                if *len == 0 || n.as_const().is_none_or(|n| start + len > n) {
                    return Err(format!("slice {start}..{} of {}", start + len, inputs[0].0));
                }
                Ok((Shape::new([t, Dim::Const(*len)]), DType::F32))
            }
            Self::ConcatRows => {
                let (first, dtype) = inputs.first().ok_or("concat_rows needs inputs")?;
                let (_, k) = f32_rows(first)?;
                let mut rows = 0;
                for (s, d) in inputs {
                    let (n, kk) = f32_rows(s)?;
                    match (n.as_const(), kk == k, d == dtype) {
                        (Some(n), true, true) => rows += n,
                        _ => return Err(format!("concat_rows: {d}{s} does not stack onto {dtype}{first}")),
                    }
                }
                Ok((Shape::new([Dim::Const(rows), k]), *dtype))
            }
            Self::ConcatColumns => {
                let ((t, m), (u, n)) = (f32_rows(inputs[0].0)?, f32_rows(inputs[1].0)?);
                match (t == u, m.as_const(), n.as_const(), inputs[0].1, inputs[1].1) {
                    (true, Some(m), Some(n), DType::F32, DType::F32) => {
                        Ok((Shape::new([t, Dim::Const(m + n)]), DType::F32))
                    }
                    _ => Err(format!("concat_columns: {} beside {}", inputs[0].0, inputs[1].0)),
                }
            }
            Self::AddRmsNorm { .. } => {
                let (t, d) = f32_rows(inputs[0].0)?;
                let fits = inputs[1].0 == inputs[0].0 && inputs[2].0 .0.as_slice() == [d];
                let twice = d.as_const().map(|d| Dim::Const(2 * d));
                match (fits, twice) {
                    (true, Some(two_d)) => Ok((Shape::new([t, two_d]), DType::F32)),
                    _ => Err(format!(
                        "add_rms_norm: {} + {} with weight {}",
                        inputs[0].0, inputs[1].0, inputs[2].0
                    )),
                }
            }
            Self::RmsNormMatMul { .. } => {
                let (t, d) = f32_rows(inputs[0].0)?;
                let (n, k) = f32_rows(inputs[2].0)?;
                if inputs[1].0 .0.as_slice() != [d] || k != d {
                    return Err(format!(
                        "rms_norm_matmul: x {} w {} W {}",
                        inputs[0].0, inputs[1].0, inputs[2].0
                    ));
                }
                Ok((Shape::new([t, n]), DType::F32))
            }
            Self::AddRmsNormMatMul { glu, .. } => {
                let (t, d) = f32_rows(inputs[0].0)?;
                let (n, k) = f32_rows(inputs[3].0)?;
                let fits = inputs[1].0 == inputs[0].0 && inputs[2].0 .0.as_slice() == [d] && k == d;
                let product = |n: usize| match glu {
                    Some(_) if n.is_multiple_of(2) => Some(n / 2),
                    Some(_) => None,
                    None => Some(n),
                };
                let widths = d.as_const().zip(n.as_const().and_then(product));
                match (fits, widths) {
                    (true, Some((d, n))) => Ok((Shape::new([t, Dim::Const(d + n)]), DType::F32)),
                    _ => Err(format!(
                        "add_rms_norm_matmul: {} + {} with weight {} and W {}",
                        inputs[0].0, inputs[1].0, inputs[2].0, inputs[3].0
                    )),
                }
            }
            Self::Glu { .. } => {
                let (t, n) = f32_rows(inputs[0].0)?;
                match n.as_const() {
                    Some(n) if n % 2 == 0 => Ok((Shape::new([t, Dim::Const(n / 2)]), DType::F32)),
                    _ => Err(format!("{}: {} has no even halves", self.name(), inputs[0].0)),
                }
            }
            Self::Elementwise { expr } => {
                let (first, _) = inputs.first().ok_or("elementwise needs inputs")?;
                if inputs.iter().any(|(s, d)| *s != *first || *d != DType::F32) || expr.arity() != inputs.len() {
                    return Err(format!(
                        "elementwise {expr} over {} inputs of differing shapes",
                        inputs.len()
                    ));
                }
                Ok(((*first).clone(), DType::F32))
            }
            Self::TopK { k } => {
                let (t, v) = f32_rows(inputs[0].0)?;
                if *k == 0 || v.as_const().is_none_or(|v| *k > v) {
                    return Err(format!("top_k {k} of {}", inputs[0].0));
                }
                Ok((Shape::new([t, Dim::Const(*k)]), DType::I32))
            }
            Self::Int8BoundTopK { k, .. } => {
                let (t, d) = f32_rows(inputs[0].0)?;
                let (v, wd) = f32_rows(inputs[1].0)?;
                if wd != d || *k == 0 || v.as_const().is_none_or(|v| *k > v) {
                    return Err(format!("int8_bound_top_k {k}: h {} W {}", inputs[0].0, inputs[1].0));
                }
                Ok((Shape::new([t, Dim::Const(*k)]), DType::I32))
            }
            Self::ShortlistTopK { k, candidates } => {
                let (t, d) = f32_rows(inputs[0].0)?;
                let (v, wd) = f32_rows(inputs[1].0)?;
                let blocks = d.as_const().is_some_and(|d| d % 32 == 0);
                if wd != d || !blocks || *k == 0 || candidates < k || v.as_const().is_none_or(|v| *k > v) {
                    return Err(format!(
                        "shortlist_top_k {k} of {candidates}: h {} W {} (rows of whole blocks of 32)",
                        inputs[0].0, inputs[1].0
                    ));
                }
                Ok((Shape::new([t, Dim::Const(*k)]), DType::I32))
            }
        }
    }

    /// Attributes in the canonical text form, e.g. `eps=1e-5, group=576`.
    pub fn attributes(&self) -> String {
        match self {
            Self::Input(kind) => kind.name().to_string(),
            Self::Weight { name } => format!("{name:?}"),
            Self::RmsNorm {
                eps,
                weight_offset,
                group,
            } => format!("eps={eps:e}, weight_offset={weight_offset}, group={group}"),
            Self::Rope(s) => rope_attributes(s),
            Self::Attention(s) | Self::SharedKvAttention(s) => attention_attributes(s),
            // The head counts and head_dim are the attention's; the rotation's own fields follow.
            Self::RopeAttention { rope, attention } => format!(
                "{}, rotary_dim={}, theta={}, position_scale={}, layout={}",
                attention_attributes(attention),
                rope.rotary_dim,
                rope.theta,
                rope.position_scale,
                layout_name(rope.layout)
            ),
            Self::Scale { factor } => format!("factor={factor}"),
            Self::SoftCap { cap } => format!("cap={cap}"),
            Self::Slice { start, len } => format!("start={start}, len={len}"),
            Self::AddRmsNorm { eps, weight_offset }
            | Self::RmsNormMatMul { eps, weight_offset }
            | Self::AddRmsNormMatMul {
                eps,
                weight_offset,
                glu: None,
            } => {
                format!("eps={eps:e}, weight_offset={weight_offset}")
            }
            Self::AddRmsNormMatMul {
                eps,
                weight_offset,
                glu: Some(act),
            } => format!("eps={eps:e}, weight_offset={weight_offset}, glu={act:?}"),
            Self::Elementwise { expr } => format!("{expr}"),
            Self::TopK { k } | Self::Int8BoundTopK { k, soft_cap: None } => format!("k={k}"),
            Self::Int8BoundTopK { k, soft_cap: Some(cap) } => format!("k={k}, soft_cap={cap}"),
            Self::ShortlistTopK { k, candidates } => format!("k={k}, candidates={candidates}"),
            Self::UnitRmsNorm { eps, group } => format!("eps={eps:e}, group={group}"),
            Self::LayerNorm { eps } => format!("eps={eps:e}"),
            Self::SparseMla(s) => {
                let mut text = format!(
                    "heads={}, nope_dim={}, rope_dim={}, value_dim={}, latent_dim={}, scale={}, index_heads={}, index_dim={}, index_topk={}, cache={}",
                    s.heads, s.nope_dim, s.rope_dim, s.value_dim, s.latent_dim, s.scale, s.index_heads, s.index_dim, s.index_topk, s.cache_slot
                );
                if !s.has_own_indexer() {
                    text += &format!(", index_cache={}", s.index_slot);
                }
                text
            }
            Self::GroupSlice { group, start, len }
            | Self::RowGroupSlice { group, start, len }
            | Self::TransposeRowGroups { group, start, len } => {
                format!("group={group}, start={start}, len={len}")
            }
            Self::GatedDeltaNet(d) => {
                let mut text = format!(
                    "key_heads={}, value_heads={}, key_dim={}, value_dim={}, conv_kernel={}, state={}",
                    d.key_heads, d.value_heads, d.key_dim, d.value_dim, d.conv_kernel, d.state_slot
                );
                // HF's layout is the default and goes unsaid.
                if d.value_head_order == ValueHeadOrder::Tiled {
                    text.push_str(", value_heads_tiled");
                }
                if d.decay_rate == DecayRate::Value {
                    text.push_str(", decay_rate=value");
                }
                text
            }
            Self::Moe(m) => {
                let router = match m.router {
                    MoeRouter::Softmax => "softmax".to_string(),
                    MoeRouter::SoftmaxExpertScale => "softmax_expert_scale".to_string(),
                    MoeRouter::GroupedSigmoid {
                        groups,
                        top_groups,
                        scaling,
                    } => format!("grouped_sigmoid(groups={groups}, top_groups={top_groups}, scaling={scaling})"),
                };
                format!(
                    "experts={}, per_token={}, router={router}, normalize={}, intermediate={}, act={:?}",
                    m.experts, m.experts_per_token, m.normalize, m.intermediate, m.act
                )
            }
            _ => String::new(),
        }
    }
}

fn layout_name(layout: RopeLayout) -> &'static str {
    match layout {
        RopeLayout::RotateHalf => "rotate_half",
        RopeLayout::AdjacentPairs => "adjacent_pairs",
        RopeLayout::Proportional => "proportional",
    }
}

fn rope_attributes(s: &RopeSpec) -> String {
    let mut text = format!(
        "heads={}, head_dim={}, rotary_dim={}, theta={}, position_scale={}, layout={}",
        s.heads,
        s.head_dim,
        s.rotary_dim,
        s.theta,
        s.position_scale,
        layout_name(s.layout)
    );
    if s.scaling != RopeScaling::None {
        text += &format!(", scaling={}", s.scaling.describe());
    }
    text
}

fn attention_attributes(s: &AttentionSpec) -> String {
    format!(
        "heads={}, kv_heads={}, head_dim={}, scale={}, window={}, cache={}{}",
        s.heads,
        s.kv_heads,
        s.head_dim,
        s.scale,
        s.window.map_or("none".to_string(), |w| w.to_string()),
        s.cache_slot,
        match s.cache_dtype {
            DType::F32 => String::new(),
            other => format!(", cache_dtype={other}"),
        }
    )
}

/// `attention(q, k, v)`'s output shape, or why the inputs do not fit `spec`.
fn attention_shape(spec: &AttentionSpec, inputs: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
    let rows = |s: &Shape| -> Result<(Dim, Dim), String> {
        match s.0.as_slice() {
            [r, c] => Ok((*r, *c)),
            _ => Err(format!("attention expects matrices, got {s}")),
        }
    };
    let (t, dq) = rows(inputs[0].0)?;
    let (tk, dk) = rows(inputs[1].0)?;
    let (tv, dv) = rows(inputs[2].0)?;
    let fits = dq == Dim::Const(spec.heads * spec.head_dim)
        && dk == Dim::Const(spec.kv_heads * spec.head_dim)
        && dv == dk
        && t == tk
        && t == tv
        && spec.kv_heads > 0
        && spec.heads.is_multiple_of(spec.kv_heads);
    if !fits {
        return Err(format!(
            "attention: q {} k {} v {} do not fit {spec:?}",
            inputs[0].0, inputs[1].0, inputs[2].0
        ));
    }
    Ok((Shape::new([t, dq]), DType::F32))
}

/// `sparse_mla(...)`'s output shape, or why the inputs do not fit `spec`.
fn sparse_mla_shape(spec: &SparseMlaSpec, inputs: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
    let c = Dim::Const;
    let s = spec;
    // Each input: an activation's row width, or a weight's shape (`k_b`, `v_b`).
    enum Fits {
        Rows(usize),
        Weight([usize; 2]),
    }
    let expected = [
        Fits::Rows(s.heads * s.nope_dim),
        Fits::Rows(s.heads * s.rope_dim),
        Fits::Rows(s.latent_dim),
        Fits::Rows(s.rope_dim),
        Fits::Weight([s.heads * s.latent_dim, s.nope_dim]),
        Fits::Weight([s.heads * s.value_dim, s.latent_dim]),
        Fits::Rows(s.index_heads * s.index_dim),
        Fits::Rows(s.index_heads),
        Fits::Rows(s.index_dim),
    ];
    let expected = &expected[..s.arity()];
    let t = inputs[0].0 .0.first().copied();
    let fits = s.heads > 0
        && s.latent_dim > 0
        && s.index_heads > 0
        && s.index_topk > 0
        && inputs.len() == expected.len()
        && inputs.iter().zip(expected).all(|((shape, dtype), want)| match *want {
            Fits::Rows(w) => *dtype == DType::F32 && t.is_some_and(|t| shape.0.as_slice() == [t, c(w)]),
            Fits::Weight([rows, cols]) => shape.0.as_slice() == [c(rows), c(cols)],
        });
    match (fits, t) {
        (true, Some(t)) => Ok((Shape::new([t, c(s.out_width())]), DType::F32)),
        _ => {
            let shapes: Vec<String> = inputs.iter().map(|(s, d)| format!("{d}{s}")).collect();
            Err(format!("sparse_mla: inputs {} do not fit {spec:?}", shapes.join(", ")))
        }
    }
}

/// `gated_delta_net(mixed, b, a, conv, a_log, dt_bias)`'s output shape, or why the inputs do
/// not fit `spec`.
fn delta_net_shape(spec: &DeltaNetSpec, inputs: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
    let c = Dim::Const;
    let fits = (|| {
        let [t, channels] = inputs[0].0 .0.as_slice() else {
            return None;
        };
        let heads_ok = spec.key_heads > 0
            && spec.value_heads.is_multiple_of(spec.key_heads)
            && spec.key_dim > 0
            && spec.value_dim > 0
            && spec.conv_kernel > 0;
        let vh = c(spec.value_heads);
        let ok = heads_ok
            && *channels == c(spec.conv_channels())
            && inputs[1].0 .0.as_slice() == [*t, vh]
            && inputs[2].0 .0.as_slice() == [*t, vh]
            && inputs[3].0 .0.as_slice() == [c(spec.conv_channels()), c(spec.conv_kernel)]
            && inputs[4].0 .0.as_slice() == [vh]
            && inputs[5].0 .0.as_slice() == [vh];
        ok.then(|| Shape::new([*t, c(spec.value_heads * spec.value_dim)]))
    })();
    fits.map(|shape| (shape, DType::F32)).ok_or_else(|| {
        let shapes: Vec<String> = inputs.iter().map(|(s, d)| format!("{d}{s}")).collect();
        format!("gated_delta_net: inputs {} do not fit {spec:?}", shapes.join(", "))
    })
}

/// `moe(x, logits, bias, gate_up, down)`'s output shape, or why the inputs do not fit `spec`.
fn moe_shape(spec: &MoeSpec, inputs: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
    let c = Dim::Const;
    let (e, i) = (spec.experts, spec.intermediate);
    let matrix = |s: &Shape| -> Option<(Dim, Dim)> {
        match s.0.as_slice() {
            [r, c] => Some((*r, *c)),
            _ => None,
        }
    };
    // The experts a token may choose from.
    let eligible = match spec.router {
        MoeRouter::Softmax | MoeRouter::SoftmaxExpertScale => e,
        MoeRouter::GroupedSigmoid { groups, top_groups, .. } => {
            let per_group = match groups {
                0 => 0,
                g if e.is_multiple_of(g) => e / g,
                _ => 0,
            };
            match per_group >= 2 && (1..=groups).contains(&top_groups) {
                true => top_groups * per_group,
                false => 0,
            }
        }
    };
    let (weights, bias) = match spec.has_expert_vector() {
        true => (&inputs[3..], Some(inputs[2].0)),
        false => (&inputs[2..], None),
    };
    let fits = (|| {
        let (t, d) = matrix(inputs[0].0)?;
        let hidden = d.as_const()?;
        let ok = (1..=eligible).contains(&spec.experts_per_token)
            && inputs[0].1 == DType::F32
            && matrix(inputs[1].0)? == (t, c(e))
            && bias.is_none_or(|b| b.0.as_slice() == [c(e)])
            && matrix(weights[0].0)? == (c(e * 2 * i), c(hidden))
            && matrix(weights[1].0)? == (c(e * hidden), c(i));
        ok.then_some(Shape::new([t, d]))
    })();
    fits.map(|shape| (shape, DType::F32)).ok_or_else(|| {
        let shapes: Vec<String> = inputs.iter().map(|(s, d)| format!("{d}{s}")).collect();
        format!("moe: inputs {} do not fit {spec:?}", shapes.join(", "))
    })
}

/// `Dim` for the step's token count, for builders.
pub const TOKENS: Dim = Dim::Sym(Sym::Tokens);
