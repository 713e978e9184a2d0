//! The meaning of each op, as plain functions over slices. The interpreter calls these; fast
//! backends reuse the cheap ones and are tested against the expensive ones.

use crate::{RopeLayout, RopeSpec};

/// RMSNorm over groups of `w.len()` elements: `x·rsqrt(mean(x²)+eps)·(w+offset)`, the mean
/// accumulated in f64 (HF normalises in fp32; f64 keeps the reference above both).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f64, weight_offset: f32, out: &mut [f32]) {
    let group = w.len();
    rms_norm_rows(
        x.chunks_exact(group).zip(out.chunks_exact_mut(group)),
        w,
        eps,
        weight_offset,
    );
}

/// [`rms_norm`] of each `(x, out)` row pair, rows wherever they lie (the CPU backend's
/// `[a + b | norm]` rows interleave the sums it normalises with the outputs).
pub fn rms_norm_rows<'a>(
    mut rows: impl Iterator<Item = (&'a [f32], &'a mut [f32])>,
    w: &[f32],
    eps: f64,
    weight_offset: f32,
) {
    loop {
        let set: [Option<(&[f32], &mut [f32])>; SUMS_TOGETHER] = std::array::from_fn(|_| rows.next());
        match set {
            [Some(r0), Some(r1), Some(r2), Some(r3)] => {
                let four = [r0, r1, r2, r3];
                let sums = sums_of_squares(four.each_ref().map(|(xg, _)| *xg));
                for ((xg, og), sum) in four.into_iter().zip(sums) {
                    normalize_row(xg, og, sum, w, eps, weight_offset);
                }
            }
            // The last rows, fewer than a set.
            rest => {
                for (xg, og) in rest.into_iter().flatten() {
                    let sum = xg.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
                    normalize_row(xg, og, sum, w, eps, weight_offset);
                }
                return;
            }
        }
    }
}

/// Rows whose sums of squares [`rms_norm_rows`] adds side by side: each row's is still added
/// in its own order (the same bits as one row at a time), but four chains of f64 additions
/// run together where one waited on its last (a SmolLM2 prefill spent 2% of its time here).
const SUMS_TOGETHER: usize = 4;

/// The f64 `Σ v²` of each of [`SUMS_TOGETHER`] rows of one length, each in its row's order.
fn sums_of_squares([a, b, c, d]: [&[f32]; SUMS_TOGETHER]) -> [f64; SUMS_TOGETHER] {
    let mut sums = [0f64; SUMS_TOGETHER];
    for (((&va, &vb), &vc), &vd) in a.iter().zip(b).zip(c).zip(d) {
        for (sum, v) in sums.iter_mut().zip([va, vb, vc, vd]) {
            *sum += (v as f64) * (v as f64);
        }
    }
    sums
}

/// `og = xg / rms · (w + weight_offset)`, the row's `Σ v²` being `sum`.
fn normalize_row(xg: &[f32], og: &mut [f32], sum: f64, w: &[f32], eps: f64, weight_offset: f32) {
    let inv = (1.0 / (sum / w.len() as f64 + eps).sqrt()) as f32;
    for ((o, &v), &wi) in og.iter_mut().zip(xg).zip(w) {
        *o = v * inv * (wi + weight_offset);
    }
}

/// HF's `inv_freq = 1 / θ^(2i/d)` for the rotary pairs, rounded to f32 as HF computes it (`d`
/// is the rotary width, or the whole head for proportional RoPE), then rescaled as the spec's
/// scaling says (Llama 3.1's or YaRN's, from the f32 frequency as HF rescales it).
pub fn rope_inv_freq(spec: &RopeSpec) -> Vec<f32> {
    let d = match spec.layout {
        RopeLayout::Proportional => spec.head_dim,
        RopeLayout::RotateHalf | RopeLayout::AdjacentPairs => spec.rotary_dim,
    };
    (0..spec.rotary_dim / 2)
        .map(|i| (i, (1.0 / spec.theta.powf(2.0 * i as f64 / d as f64)) as f32))
        .map(|(i, f)| spec.scaling.rescale(i, f, d, spec.theta))
        .collect()
}

/// (cos, sin) of every rotary frequency at one position: angle = (pos / scale) · inv_freq in
/// f32 (as HF multiplies), then cos/sin of that angle, times the scaling's attention factor
/// (YaRN's; 1 otherwise, which changes no bit).
pub fn rope_cos_sin(spec: &RopeSpec, inv_freq: &[f32], position: usize, cos: &mut [f32], sin: &mut [f32]) {
    let pos = (position as f64 / spec.position_scale) as f32;
    let factor = spec.scaling.attention_factor();
    for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
        let angle = (pos * f) as f64;
        *c = angle.cos() as f32 * factor;
        *s = angle.sin() as f32 * factor;
    }
}

/// Rotate one token's `[heads·head_dim]` row in place, given its (cos, sin).
pub fn rope_row(spec: &RopeSpec, row: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = spec.rotary_dim / 2;
    let (cos, sin) = (&cos[..half], &sin[..half]);
    for head in row.chunks_exact_mut(spec.head_dim) {
        // Each pair's elements `x0` (at `i` or `2i`) and `x1`; the halves' pairs as two
        // disjoint slices, which the compiler turns into vector arithmetic (the same operations
        // in the same order: the same bits as pair by pair).
        let rotate = |x0: &mut f32, x1: &mut f32, (c, s): (f32, f32)| {
            let (a, b) = (*x0, *x1);
            *x0 = a * c - b * s;
            *x1 = b * c + a * s;
        };
        let pairs = cos.iter().copied().zip(sin.iter().copied());
        match spec.layout {
            RopeLayout::AdjacentPairs => {
                for (pair, cs) in head.chunks_exact_mut(2).zip(pairs) {
                    let [x0, x1] = pair else { unreachable!("pairs of two") };
                    rotate(x0, x1, cs);
                }
            }
            RopeLayout::RotateHalf | RopeLayout::Proportional => {
                let second = match spec.layout {
                    RopeLayout::RotateHalf => half,
                    _ => spec.head_dim / 2,
                };
                let (first, rest) = head.split_at_mut(second);
                for ((x0, x1), cs) in first[..half].iter_mut().zip(&mut rest[..half]).zip(pairs) {
                    rotate(x0, x1, cs);
                }
            }
        }
    }
}

pub fn rope(spec: &RopeSpec, x: &mut [f32], positions: &[usize]) {
    let inv_freq = rope_inv_freq(spec);
    let (mut cos, mut sin) = (vec![0f32; inv_freq.len()], vec![0f32; inv_freq.len()]);
    for (row, &p) in x.chunks_exact_mut(spec.heads * spec.head_dim).zip(positions) {
        rope_cos_sin(spec, &inv_freq, p, &mut cos, &mut sin);
        rope_row(spec, row, &cos, &sin);
    }
}

/// `rope_attention`'s rotation of `q` (`heads` heads) and `k` (`kv_heads` heads) in place:
/// `spec` is the rotation of every head of `[q | k]`.
pub fn rope_q_k(spec: &RopeSpec, heads: usize, kv_heads: usize, q: &mut [f32], k: &mut [f32], positions: &[usize]) {
    rope(&RopeSpec { heads, ..*spec }, q, positions);
    rope(
        &RopeSpec {
            heads: kv_heads,
            ..*spec
        },
        k,
        positions,
    );
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// PyTorch's `gelu(x, approximate="tanh")`.
pub fn gelu_tanh(x: f32) -> f32 {
    let x64 = x as f64;
    let inner = (2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044715 * x64 * x64 * x64);
    (0.5 * x64 * (1.0 + inner.tanh())) as f32
}

/// `out[t, n] = Σ_k x[t, k]·w[n, k]`, accumulated in f64.
pub fn matmul(x: &[f32], w: &[f32], k: usize, out: &mut [f32]) {
    let n = w.len() / k;
    for (xr, or) in x.chunks_exact(k).zip(out.chunks_exact_mut(n)) {
        for (o, wr) in or.iter_mut().zip(w.chunks_exact(k)) {
            *o = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
        }
    }
}

/// `row` (whole blocks of 32) through a 4-bit copy and back, as llama.cpp's Q4_0 keeps it:
/// per block the value of largest magnitude `m` sets the scale `d = m / −8` (an f16), and each
/// value becomes `d·(q − 8)` for `q = ⌊x/d + 8.5⌋` within 0..=15.
pub fn four_bit_row(row: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(row.len());
    for block in row.chunks(32) {
        let m = block.iter().fold(0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
        let d = half::f16::from_f32(m / -8.0).to_f32();
        let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(block.iter().map(|&x| {
            let q = ((x * inverse + 8.5) as i32).clamp(0, 15);
            d * (q - 8) as f32
        }));
    }
    out
}

/// Whether a query at `q_pos` may attend to a key at `k_pos` (causal, optional sliding window).
pub fn attends(q_pos: usize, k_pos: usize, window: Option<usize>) -> bool {
    k_pos <= q_pos && window.is_none_or(|w| q_pos - k_pos < w)
}

/// Columns `start..start+len` of every row.
pub fn slice_columns(x: &[f32], row_len: usize, start: usize, len: usize) -> Vec<f32> {
    x.chunks_exact(row_len)
        .flat_map(|r| r[start..start + len].iter().copied())
        .collect()
}

/// `x` as a buffer of `dtype` stores it and reads it back: rounded to nearest even for bf16
/// and IEEE half (KV caches of those element types), unchanged for f32.
pub fn stored_as(x: f32, dtype: crate::DType) -> f32 {
    match dtype {
        crate::DType::BF16 => half::bf16::from_f32(x).to_f32(),
        crate::DType::F16 => half::f16::from_f32(x).to_f32(),
        crate::DType::F8E4M3 => crate::F8E4M3::from_f32(x).to_f32(),
        _ => x,
    }
}

/// `[a | b]` per row, rows of `a` `a_len` and of `b` `b_len` elements wide.
pub fn concat_columns(a: &[f32], a_len: usize, b: &[f32], b_len: usize) -> Vec<f32> {
    let rows = a.len() / a_len.max(1);
    (0..rows)
        .flat_map(|r| {
            a[r * a_len..(r + 1) * a_len]
                .iter()
                .chain(&b[r * b_len..(r + 1) * b_len])
        })
        .copied()
        .collect()
}

/// `[a + b | rms_norm(a + b)]` per row of `d` elements.
pub fn add_rms_norm(a: &[f32], b: &[f32], w: &[f32], eps: f64, weight_offset: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = Vec::with_capacity(2 * a.len());
    let mut normed = vec![0f32; d];
    for (ar, br) in a.chunks_exact(d).zip(b.chunks_exact(d)) {
        let sum: Vec<f32> = ar.iter().zip(br).map(|(x, y)| x + y).collect();
        rms_norm(&sum, w, eps, weight_offset, &mut normed);
        out.extend_from_slice(&sum);
        out.extend_from_slice(&normed);
    }
    out
}

/// `act(x[:, :n]) · x[:, n:]` per row of `2n` elements.
pub fn glu(x: &[f32], row_len: usize, act: crate::GluAct) -> Vec<f32> {
    let n = row_len / 2;
    let f = match act {
        crate::GluAct::Silu => silu,
        crate::GluAct::GeluTanh => gelu_tanh,
    };
    x.chunks_exact(row_len)
        .flat_map(|r| (0..n).map(move |i| f(r[i]) * r[n + i]))
        .collect()
}

/// `x + b` for every row of `b.len()` elements.
pub fn add_bias(x: &[f32], b: &[f32]) -> Vec<f32> {
    x.chunks_exact(b.len())
        .flat_map(|r| r.iter().zip(b).map(|(x, b)| x + b))
        .collect()
}

/// The experts one token goes to and their weights, ascending by expert, as HF routes them
/// (see [`crate::MoeRouter`]). `per_expert` is the router's vector (the grouped router's
/// score bias, the experts' scales; empty for plain softmax).
pub fn moe_route(logits: &[f32], per_expert: &[f32], spec: &crate::MoeSpec) -> Vec<(usize, f32)> {
    let (scores, mut chosen, scaling) = match spec.router {
        crate::MoeRouter::Softmax | crate::MoeRouter::SoftmaxExpertScale => {
            let scores = softmax(logits);
            let chosen = top_k(&scores, spec.experts_per_token);
            (scores, chosen, 1.0)
        }
        crate::MoeRouter::GroupedSigmoid {
            groups,
            top_groups,
            scaling,
        } => {
            let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
            let chosen = grouped_choice(&scores, per_expert, groups, top_groups, spec.experts_per_token);
            (scores, chosen, scaling)
        }
    };
    chosen.sort_unstable();
    let total: f32 = chosen.iter().map(|&e| scores[e]).sum();
    chosen
        .into_iter()
        .map(|e| {
            let w = if spec.normalize {
                scores[e] / (total + 1e-20)
            } else {
                scores[e]
            };
            match spec.router {
                crate::MoeRouter::SoftmaxExpertScale => (e, w * per_expert[e]),
                _ => (e, w * scaling),
            }
        })
        .collect()
}

/// DeepSeek-V3's choice: rank `score + bias`, first the groups by the sum of their two best,
/// then the experts of the `top_groups` best groups (the others count as 0, as HF masks them).
fn grouped_choice(scores: &[f32], bias: &[f32], groups: usize, top_groups: usize, k: usize) -> Vec<usize> {
    let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let per_group = scores.len() / groups;
    let group_scores: Vec<f32> = choice
        .chunks_exact(per_group)
        .map(|g| top_k(g, 2).iter().map(|&i| g[i]).sum())
        .collect();
    let best = top_k(&group_scores, top_groups);
    let masked: Vec<f32> = choice
        .iter()
        .enumerate()
        .map(|(e, &c)| if best.contains(&(e / per_group)) { c } else { 0.0 })
        .collect();
    top_k(&masked, k)
}

/// A softmax in f64, rounded to f32 (PyTorch's float softmax, to within rounding).
fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let exps: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp()).collect();
    let total: f64 = exps.iter().sum();
    exps.iter().map(|e| (e / total) as f32).collect()
}

/// `cap · tanh(x / cap)`: the division in f32 as PyTorch divides, the tanh in f64.
pub fn soft_cap(x: f32, cap: f32) -> f32 {
    ((x / cap) as f64).tanh() as f32 * cap
}

/// `1 / (1 + e^−x)`, in f64.
pub fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

/// The routed experts' weighted sum for every row of `x` (`Op::Moe`; `bias` empty for routers
/// without one); f64 accumulation in each expert's products, experts added in ascending order
/// as HF adds them.
pub fn moe(x: &[f32], logits: &[f32], bias: &[f32], gate_up: &[f32], down: &[f32], spec: &crate::MoeSpec) -> Vec<f32> {
    let d = gate_up.len() / (spec.experts * 2 * spec.intermediate);
    let i = spec.intermediate;
    let mut out = vec![0f32; x.len()];
    for ((xr, lr), or) in x
        .chunks_exact(d)
        .zip(logits.chunks_exact(spec.experts))
        .zip(out.chunks_exact_mut(d))
    {
        for (e, w) in moe_route(lr, bias, spec) {
            let mut h = vec![0f32; 2 * i];
            matmul(xr, &gate_up[e * 2 * i * d..(e + 1) * 2 * i * d], d, &mut h);
            let m = glu(&h, 2 * i, spec.act);
            let mut y = vec![0f32; d];
            matmul(&m, &down[e * d * i..(e + 1) * d * i], i, &mut y);
            for (o, y) in or.iter_mut().zip(&y) {
                *o += y * w;
            }
        }
    }
    out
}

/// Columns `start..start+len` of every group of `group` columns, row by row.
pub fn group_slice(x: &[f32], group: usize, start: usize, len: usize) -> Vec<f32> {
    x.chunks_exact(group)
        .flat_map(|g| &g[start..start + len])
        .copied()
        .collect()
}

/// Each row of `x` (rows of `row_len`) times its scalar, or all times `scalars[0]` when there
/// is one scalar for all.
/// A column order read from a weight's values (as the interpreter and the CPU backend
/// read every weight: f32, each index exact), or why it is no permutation of its columns (or
/// empty: no layer has rows of none).
pub fn column_order(values: &[f32]) -> Result<Vec<usize>, String> {
    if values.is_empty() {
        return Err("a column order of no columns".into());
    }
    let mut seen = vec![false; values.len()];
    let mut order = Vec::with_capacity(values.len());
    for &v in values {
        let at = v as usize;
        if v.fract() != 0.0 || v < 0.0 || at >= values.len() || std::mem::replace(&mut seen[at], true) {
            return Err(format!(
                "a column order of {} names column {v} twice or out of range",
                values.len()
            ));
        }
        order.push(at);
    }
    Ok(order)
}

/// Each row of `x` (rows of `order.len()`) with its columns in `order`: column `j` of a row
/// is its column `order[j]`.
pub fn permute_columns(x: &[f32], order: &[usize]) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    permute_columns_into(x, order, &mut out);
    out
}

/// [`permute_columns`] into `out` (as long as `x`).
pub fn permute_columns_into(x: &[f32], order: &[usize], out: &mut [f32]) {
    for (row, x) in out.chunks_exact_mut(order.len()).zip(x.chunks_exact(order.len())) {
        for (o, &c) in row.iter_mut().zip(order) {
            *o = x[c];
        }
    }
}

pub fn scale_rows(x: &[f32], row_len: usize, scalars: &[f32]) -> Vec<f32> {
    x.chunks_exact(row_len.max(1))
        .enumerate()
        .flat_map(|(r, row)| {
            let s = scalars[if scalars.len() == 1 { 0 } else { r }];
            row.iter().map(move |v| v * s)
        })
        .collect()
}

/// RMSNorm over groups of `group` without a weight.
pub fn unit_rms_norm(x: &[f32], group: usize, eps: f64) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    rms_norm(x, &vec![1.0; group], eps, 0.0, &mut out);
    out
}

/// PyTorch's `softplus` (β = 1, threshold 20: linear above it).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (x as f64).exp().ln_1p() as f32
    }
}

/// A value head's decay for one row, `g = exp(A·softplus(a + dt_bias))`, `A` from its stored
/// form (`A_log` or `A` itself, as the spec's `decay_rate` says).
pub fn delta_net_decay(spec: &crate::DeltaNetSpec, stored_rate: f32, a: f32, dt_bias: f32) -> f32 {
    let rate = match spec.decay_rate {
        crate::DecayRate::Log => -(stored_rate as f64).exp() as f32,
        crate::DecayRate::Value => stored_rate,
    };
    (rate * softplus(a + dt_bias)).exp()
}

/// `x / √(Σx² + 1e-6)`, as FLA and HF normalise DeltaNet queries and keys.
pub fn l2_normalize(x: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = (1.0 / (sum + 1e-6).sqrt()) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `Op::GatedDeltaNet` over one sequence's rows, in order, continuing from `state` (see
/// [`crate::DeltaNetSpec::state_len`]; all zeros at the sequence's start) and leaving it after
/// the last row. Returns `[rows, value_heads·value_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_net(
    spec: &crate::DeltaNetSpec,
    mixed: &[f32],
    b: &[f32],
    a: &[f32],
    conv: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    state: &mut [f32],
) -> Vec<f32> {
    let (channels, kernel) = (spec.conv_channels(), spec.conv_kernel);
    let (kh, vh, dk, dv) = (spec.key_heads, spec.value_heads, spec.key_dim, spec.value_dim);
    let (window, recurrent) = state.split_at_mut((kernel - 1) * channels);
    let mut out = Vec::with_capacity(mixed.len() / channels * vh * dv);
    let mut x = vec![0f32; channels];
    for ((row, b), a) in mixed
        .chunks_exact(channels)
        .zip(b.chunks_exact(vh))
        .zip(a.chunks_exact(vh))
    {
        causal_conv_step(conv, kernel, window, row, &mut x);
        x.iter_mut().for_each(|v| *v = silu(*v));
        let (q, rest) = x.split_at_mut(kh * dk);
        let (k, v) = rest.split_at_mut(kh * dk);
        for head in q.chunks_exact_mut(dk).chain(k.chunks_exact_mut(dk)) {
            l2_normalize(head);
        }
        let q_scale = 1.0 / (dk as f32).sqrt();
        for h in 0..vh {
            let key_head = spec.key_head(h);
            let qh: Vec<f32> = q[key_head * dk..(key_head + 1) * dk]
                .iter()
                .map(|v| v * q_scale)
                .collect();
            let kh_ = &k[key_head * dk..(key_head + 1) * dk];
            let vh_ = &v[h * dv..(h + 1) * dv];
            let decay = delta_net_decay(spec, a_log[h], a[h], dt_bias[h]);
            let beta = sigmoid(b[h]);
            let s = &mut recurrent[h * dk * dv..(h + 1) * dk * dv];
            s.iter_mut().for_each(|v| *v *= decay);
            let read = |s: &[f32], along: &[f32], j: usize| -> f32 {
                (0..dk).map(|i| s[i * dv + j] as f64 * along[i] as f64).sum::<f64>() as f32
            };
            let delta: Vec<f32> = (0..dv).map(|j| (vh_[j] - read(s, kh_, j)) * beta).collect();
            for (i, &ki) in kh_.iter().enumerate() {
                for (sij, dj) in s[i * dv..(i + 1) * dv].iter_mut().zip(&delta) {
                    *sij += ki * dj;
                }
            }
            out.extend((0..dv).map(|j| read(s, &qh, j)));
        }
    }
    out
}

/// One token through the depthwise causal convolution: `out[c] = Σ_j w[c, j]·x[t − K + 1 + j, c]`
/// over the `window` of the previous `K − 1` inputs (`[K − 1, channels]`, oldest first) and
/// `row`; then `row` joins the window and its oldest input leaves.
pub fn causal_conv_step(conv: &[f32], kernel: usize, window: &mut [f32], row: &[f32], out: &mut [f32]) {
    let channels = row.len();
    for (c, o) in out.iter_mut().enumerate() {
        let w = &conv[c * kernel..(c + 1) * kernel];
        let past: f32 = (0..kernel - 1).map(|j| w[j] * window[j * channels + c]).sum();
        *o = past + w[kernel - 1] * row[c];
    }
    if kernel > 1 {
        window.copy_within(channels.., 0);
        window[(kernel - 2) * channels..].copy_from_slice(row);
    }
}

/// Rows `start..start+len` of every group of `group` rows of `w` (rows of `k`).
pub fn row_group_slice(w: &[f32], k: usize, group: usize, start: usize, len: usize) -> Vec<f32> {
    w.chunks_exact(group * k)
        .flat_map(|g| &g[start * k..(start + len) * k])
        .copied()
        .collect()
}

/// LayerNorm of every row of `w.len()`: `(x − mean) · rsqrt(var + eps) · w + b`, moments in f64.
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f64) -> Vec<f32> {
    let n = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        let inv = 1.0 / (var + eps).sqrt();
        out.extend(
            row.iter()
                .zip(w)
                .zip(b)
                .map(|((&v, &w), &b)| ((v as f64 - mean) * inv) as f32 * w + b),
        );
    }
    out
}

/// A cached latent row `[c | k_pe | …]` of `Op::SparseMla` expanded through `k_b`
/// (`[heads·latent, nope]`, each head's `W_UKᵀ`) and `v_b` (`[heads·value, latent]`): the key
/// row `[k_nope (heads·nope) | k_pe]` and the value row (`heads·value`) of an
/// [`MlaCandidate`]. f64 sums, f32 results.
pub fn mla_expand(spec: &crate::SparseMlaSpec, k_b: &[f32], v_b: &[f32], row: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (n, v, l) = (spec.nope_dim, spec.value_dim, spec.latent_dim);
    let (latent, rest) = row.split_at(l);
    let k_pe = &rest[..spec.rope_dim];
    // k_nope[h, i] = Σ_j W_UK[h][i, j]·c[j], W_UK[h][i, j] = k_b[h·l + j, i].
    let key_nope = |h: usize, i: usize| {
        (0..l)
            .map(|j| k_b[(h * l + j) * n + i] as f64 * latent[j] as f64)
            .sum::<f64>() as f32
    };
    let value = |r: usize| {
        let w = &v_b[r * l..(r + 1) * l];
        w.iter().zip(latent).map(|(&w, &c)| w as f64 * c as f64).sum::<f64>() as f32
    };
    let mut key: Vec<f32> = (0..spec.heads)
        .flat_map(|h| (0..n).map(move |i| (h, i)))
        .map(|(h, i)| key_nope(h, i))
        .collect();
    key.extend_from_slice(k_pe);
    (key, (0..spec.heads * v).map(value).collect())
}

/// Rows `start..start+len` of every group of `group` rows of `w` (rows of `k`), each group's
/// `[len, k]` block transposed to `[k, len]`.
pub fn transpose_row_groups(w: &[f32], k: usize, group: usize, start: usize, len: usize) -> Vec<f32> {
    transposed_row_groups_order(w.len() / k, k, group, start, len)
        .map(|i| w[i])
        .collect()
}

/// The element of a `[rows, cols]` matrix that each element of its `transpose_row_groups`
/// comes from, in order (every layout of the transform reads this order).
pub fn transposed_row_groups_order(
    rows: usize,
    cols: usize,
    group: usize,
    start: usize,
    len: usize,
) -> impl Iterator<Item = usize> {
    (0..rows / group.max(1))
        .flat_map(move |g| (0..cols).flat_map(move |c| (start..start + len).map(move |r| (g * group + r) * cols + c)))
}

/// Which of a query's candidate positions the sparse indexer keeps (ascending), given each
/// candidate's index key: the `index_topk` best by `Σ_i w_i · ih^−½ · id^−½ · relu(q_i · k)`.
/// Equal scores (the ReLU makes exact zeros common) keep the earlier position, whatever else
/// shares the step; a zero is one score whatever its sign (`+ 0.0` makes −0 +0, which
/// `top_k`'s total order would rank below it). f64 sums.
pub fn sparse_index_kept(
    spec: &crate::SparseMlaSpec,
    index_q: &[f32],
    index_weights: &[f32],
    keys: &[&[f32]],
) -> Vec<usize> {
    let (ih, id) = (spec.index_heads, spec.index_dim);
    let weight_scale = (ih as f64).powf(-0.5) * (id as f64).powf(-0.5);
    let scores: Vec<f32> = keys
        .iter()
        .map(|k| {
            (0..ih)
                .map(|i| index_weights[i] as f64 * weight_scale * dot(&index_q[i * id..(i + 1) * id], k).max(0.0))
                .sum::<f64>() as f32
                + 0.0
        })
        .collect();
    let mut kept = top_k(&scores, spec.index_topk.min(keys.len()));
    kept.sort_unstable();
    kept
}

/// `Σ a·b`, accumulated in f64 (as [`matmul`]).
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// A cached position as [`sparse_mla_query`] reads it: its expanded key row
/// `[k_nope (heads·nope) | k_pe]` and value row ([`mla_expand`]), and the index key it is
/// ranked by.
pub struct MlaCandidate<'a> {
    pub key: &'a [f32],
    pub value: &'a [f32],
    pub index_key: &'a [f32],
}

/// One query of `Op::SparseMla` over `candidates`, the cached positions it may see
/// (ascending): the indexer keeps the `index_topk` best, and every head attends over those.
/// `q` is the query's row of each input: `[q_nope, q_pe, index_q, index_weights]`. f64
/// accumulation.
pub fn sparse_mla_query(spec: &crate::SparseMlaSpec, q: [&[f32]; 4], candidates: &[MlaCandidate]) -> Vec<f32> {
    let [q_nope, q_pe, index_q, index_weights] = q;
    let (h, n, r, v) = (spec.heads, spec.nope_dim, spec.rope_dim, spec.value_dim);
    let index_keys: Vec<&[f32]> = candidates.iter().map(|c| c.index_key).collect();
    let kept = sparse_index_kept(spec, index_q, index_weights, &index_keys);
    let mut out = vec![0f32; h * v];
    for head in 0..h {
        let (qn, qp) = (&q_nope[head * n..(head + 1) * n], &q_pe[head * r..(head + 1) * r]);
        let scores: Vec<f64> = kept
            .iter()
            .map(|&j| {
                let key = candidates[j].key;
                (dot(qn, &key[head * n..(head + 1) * n]) + dot(qp, &key[h * n..h * n + r])) * spec.scale
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = exps.iter().sum();
        for (d, o) in out[head * v..(head + 1) * v].iter_mut().enumerate() {
            let acc: f64 = kept
                .iter()
                .zip(&exps)
                .map(|(&j, &e)| e * candidates[j].value[head * v + d] as f64)
                .sum();
            *o = (acc / total) as f32;
        }
    }
    out
}

/// Indices of the `k` largest values of a row, largest first; equal values keep the lower
/// index first (the tie rule every argmax in bbc follows). NaN sorts below everything.
pub fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let key = |i: usize| {
        if row[i].is_nan() {
            f32::NEG_INFINITY
        } else {
            row[i]
        }
    };
    let order = |&a: &usize, &b: &usize| key(b).total_cmp(&key(a)).then(a.cmp(&b));
    // Greedy decoding's argmax in one pass, without the index list (a vocabulary of 262k
    // entries made selecting its best a few percent of a Gemma 3 decode step).
    if k == 1 {
        return (0..row.len()).min_by(order).into_iter().collect();
    }
    let mut idx: Vec<usize> = (0..row.len()).collect();
    // Select the k best first (linear time), then order only those: vocabularies are large.
    if k < idx.len() {
        if k == 0 {
            return Vec::new();
        }
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_by(order);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A column order read from a weight's values takes each column once; anything else
    /// (a column twice, one out of range, a fraction, a negative, NaN) is refused. Rows take
    /// their columns in it.
    #[test]
    fn columns_are_taken_in_an_order_that_names_each_once() {
        assert_eq!(column_order(&[2.0, 0.0, 1.0]), Ok(vec![2, 0, 1]));
        assert!(column_order(&[]).is_err());
        for bad in [
            [2.0, 0.0, 2.0],
            [3.0, 0.0, 1.0],
            [0.5, 1.0, 2.0],
            [-1.0, 1.0, 2.0],
            [f32::NAN, 1.0, 2.0],
        ] {
            assert!(column_order(&bad).is_err(), "{bad:?}");
        }
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(permute_columns(&x, &[2, 0, 1]), [3.0, 1.0, 2.0, 6.0, 4.0, 5.0]);
    }

    /// Rows normalised four at a time give each row the bits it gets alone: every row count
    /// from one to nine (whole sets of four and the rest), values of many magnitudes.
    #[test]
    fn rms_norm_of_many_rows_is_each_rows_own() {
        let group = 37;
        let w: Vec<f32> = (0..group).map(|i| 0.5 + i as f32 / 16.0).collect();
        for rows in 1..=9 {
            let x: Vec<f32> = (0..rows * group)
                .map(|i| ((i * 7919 % 1009) as f32 - 504.0) * 10f32.powi((i % 9) as i32 - 4))
                .collect();
            let mut together = vec![0f32; x.len()];
            rms_norm(&x, &w, 1e-6, 1.0, &mut together);
            for (r, xg) in x.chunks_exact(group).enumerate() {
                let mut alone = vec![0f32; group];
                rms_norm(xg, &w, 1e-6, 1.0, &mut alone);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&together[r * group..(r + 1) * group]),
                    bits(&alone),
                    "row {r} of {rows}"
                );
                // Alone, a row takes the one-row path: the sum in the row's order.
                let sum = xg.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
                let inv = (1.0 / (sum / group as f64 + 1e-6).sqrt()) as f32;
                assert_eq!(alone[3].to_bits(), (xg[3] * inv * (w[3] + 1.0)).to_bits());
            }
        }
    }

    /// `rope_row` rotates each pair as the formula does, pair by pair, to the bit, in every
    /// layout, with a partial rotary width and the elements past it left alone.
    #[test]
    fn rope_row_rotates_each_pair_as_the_formula_does() {
        for layout in [
            RopeLayout::RotateHalf,
            RopeLayout::AdjacentPairs,
            RopeLayout::Proportional,
        ] {
            for (head_dim, rotary_dim) in [(8, 8), (16, 8), (128, 128), (64, 40)] {
                let spec = RopeSpec {
                    heads: 3,
                    head_dim,
                    rotary_dim,
                    theta: 10000.0,
                    position_scale: 1.0,
                    layout,
                    scaling: crate::RopeScaling::None,
                };
                let half = rotary_dim / 2;
                let row: Vec<f32> = (0..3 * head_dim)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                    .collect();
                let cos: Vec<f32> = (0..half).map(|i| (i as f32 * 0.3).cos()).collect();
                let sin: Vec<f32> = (0..half).map(|i| (i as f32 * 0.3).sin()).collect();
                let mut want = row.clone();
                for head in want.chunks_exact_mut(head_dim) {
                    for i in 0..half {
                        let (a, b) = match layout {
                            RopeLayout::RotateHalf => (i, i + half),
                            RopeLayout::AdjacentPairs => (2 * i, 2 * i + 1),
                            RopeLayout::Proportional => (i, i + head_dim / 2),
                        };
                        let (x0, x1) = (head[a], head[b]);
                        head[a] = x0 * cos[i] - x1 * sin[i];
                        head[b] = x1 * cos[i] + x0 * sin[i];
                    }
                }
                let mut got = row.clone();
                rope_row(&spec, &mut got, &cos, &sin);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{layout:?} {head_dim}/{rotary_dim}");
            }
        }
    }

    #[test]
    fn transpose_row_groups_transposes_each_groups_picked_rows() {
        // Two groups of 3 rows of 2; rows 1..3 of each, transposed to [2, 2].
        let w = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0];
        assert_eq!(
            transpose_row_groups(&w, 2, 3, 1, 2),
            [2.0, 4.0, 3.0, 5.0, 8.0, 10.0, 9.0, 11.0]
        );
    }

    fn router(per_token: usize, top_groups: usize, normalize: bool) -> crate::MoeSpec {
        crate::MoeSpec {
            experts: 8,
            experts_per_token: per_token,
            normalize,
            intermediate: 4,
            act: crate::GluAct::Silu,
            router: crate::MoeRouter::GroupedSigmoid {
                groups: 2,
                top_groups,
                scaling: 2.5,
            },
        }
    }

    #[test]
    fn moe_route_softmax_takes_the_most_likely_and_renormalizes() {
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let spec = crate::MoeSpec {
            experts: 4,
            experts_per_token: 2,
            normalize: false,
            intermediate: 4,
            act: crate::GluAct::Silu,
            router: crate::MoeRouter::Softmax,
        };
        let p = softmax(&logits);
        let route = moe_route(&logits, &[], &spec);
        assert_eq!(route, vec![(1, p[1]), (2, p[2])]);
        let normalized = moe_route(
            &logits,
            &[],
            &crate::MoeSpec {
                normalize: true,
                ..spec
            },
        );
        let sum = p[1] + p[2];
        assert!((normalized[0].1 - p[1] / sum).abs() < 1e-6 && (normalized[1].1 - p[2] / sum).abs() < 1e-6);
    }

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn moe_route_chooses_inside_the_group_with_the_best_two() {
        // Expert 5 (group 1) scores best alone, but group 0's two best sum higher (0.9 + 0.85
        // against 0.95 + 0.1).
        let p = [0.9, 0.85, 0.1, 0.1, 0.1, 0.95, 0.1, 0.1];
        let logits: Vec<f32> = p.iter().map(|&p| logit(p)).collect();
        let route = moe_route(&logits, &[0.0; 8], &router(2, 1, true));
        let experts: Vec<usize> = route.iter().map(|r| r.0).collect();
        assert_eq!(experts, vec![0, 1]);
        let total: f32 = route.iter().map(|r| r.1).sum();
        assert!(
            (total - 2.5).abs() < 1e-5,
            "normalized weights sum to the scaling: {total}"
        );
        assert!((route[0].1 - 2.5 * 0.9 / 1.75).abs() < 1e-5);
        // With both groups open the best single expert is chosen.
        let both: Vec<usize> = moe_route(&logits, &[0.0; 8], &router(2, 2, true))
            .iter()
            .map(|r| r.0)
            .collect();
        assert_eq!(both, vec![0, 5]);
    }

    #[test]
    fn moe_route_bias_steers_the_choice_but_not_the_weights() {
        let p = [0.5, 0.6, 0.7, 0.8, 0.1, 0.1, 0.1, 0.1];
        let logits: Vec<f32> = p.iter().map(|&p| logit(p)).collect();
        let mut bias = [0.0f32; 8];
        bias[0] = 1.0;
        let route = moe_route(&logits, &bias, &router(2, 1, false));
        assert_eq!(route.iter().map(|r| r.0).collect::<Vec<_>>(), vec![0, 3]);
        // Unnormalized: the chosen experts' own scores times the scaling, bias left out.
        assert!((route[0].1 - 0.5 * 2.5).abs() < 1e-5 && (route[1].1 - 0.8 * 2.5).abs() < 1e-5);
    }

    #[test]
    fn moe_route_masks_other_groups_with_zero_as_hf_does() {
        // Negative biases push every choice in the chosen group below 0: HF fills the other
        // groups' choices with 0.0, not −∞, so their experts win the top-k there.
        let p = [0.5; 8];
        let logits: Vec<f32> = p.iter().map(|&p| logit(p)).collect();
        let bias = [-0.6, -0.7, -0.8, -0.9, -2.0, -2.0, -2.0, -2.0];
        let route = moe_route(&logits, &bias, &router(2, 1, true));
        assert_eq!(route.iter().map(|r| r.0).collect::<Vec<_>>(), vec![4, 5]);
    }

    #[test]
    fn top_k_orders_by_value_then_index_and_skips_nan() {
        let row = [1.0, 3.0, f32::NAN, 3.0, 2.0, 3.0];
        assert_eq!(top_k(&row, 1), vec![1]);
        assert_eq!(top_k(&row, 4), vec![1, 3, 5, 4]);
        assert_eq!(top_k(&row, 6), vec![1, 3, 5, 4, 0, 2]);
        assert_eq!(top_k(&row, 0), Vec::<usize>::new());
        assert_eq!(top_k(&[], 1), Vec::<usize>::new());
        assert_eq!(top_k(&[f32::NAN, f32::NAN], 1), vec![0]);
        assert_eq!(top_k(&[f32::NAN, f32::NEG_INFINITY, 1.0, 1.0], 1), vec![2]);
        assert_eq!(top_k(&[f32::NAN, f32::NEG_INFINITY], 1), vec![0]);
        // The one-pass argmax is the selection's first, on rows of repeats, NaNs and infinities.
        let values = [f32::NAN, f32::NEG_INFINITY, -1.5, 0.25, 2.0, 2.0, f32::INFINITY];
        for seed in 0..200usize {
            let row: Vec<f32> = (0..1 + seed % 17)
                .map(|i| values[(i * 7 + seed * 13) % (3 + seed % 5)])
                .collect();
            assert_eq!(top_k(&row, 1)[0], top_k(&row, 2)[0], "{row:?}");
        }
    }
}
