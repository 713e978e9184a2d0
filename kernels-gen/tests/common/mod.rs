//! Shared by the emulator tests: deterministic data, scalar arguments, comparison with a
//! tolerance, and the matmul launch (GEMV or GEMM) several tests make.
#![allow(dead_code)]

use half::bf16;
use kernels_gen::dsl::{Kernel, Role, Roles, Stmt, Ty};
use kernels_gen::emulator::{run, run_profiled, Array, EmuError, Scalar, SharedTraffic};
use kernels_gen::templates::prologue_norms;
use std::collections::HashMap;

/// A small LCG: the same values on every run and machine, in [-1, 1).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

pub fn ints(pairs: &[(&str, i64)]) -> HashMap<String, Scalar> {
    pairs.iter().map(|(k, v)| (k.to_string(), Scalar::Int(*v))).collect()
}

/// The first `width` values of each of `rows` rows lying `stride` apart in `v` (a kernel's
/// strided input), packed: what the reference takes.
pub fn rows_of(v: &[f32], rows: usize, width: usize, stride: usize) -> Vec<f32> {
    (0..rows)
        .flat_map(|r| v[r * stride..r * stride + width].to_vec())
        .collect()
}

/// Every element within `tol` of the reference, relative to its largest magnitude.
pub fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * scale, "{what}[{i}]: {g} vs {w}");
    }
}

/// Run a GEMV kernel (`gemv::gemv` without the norm prologue) on `x` [tokens, x_stride] and weights `w` of
/// `n` rows by `k`; its `out` buffer, poisoned before the launch.
pub fn run_gemv(kernel: &Kernel, x: &[f32], w: Array, dims: (usize, usize, usize, usize)) -> Array {
    run_norm_gemv(kernel, x, None, w, dims)
}

/// `run_gemv` for a GEMV with the RMSNorm prologue too, whose norm weight is `g`.
pub fn run_norm_gemv(
    kernel: &Kernel,
    x: &[f32],
    g: Option<&[f32]>,
    w: Array,
    dims: (usize, usize, usize, usize),
) -> Array {
    try_run_matmul(kernel, Array::f32(x), g, w, dims).expect("the GEMV runs cleanly")
}

/// Run a matmul kernel (a GEMV or a prefill GEMM: buffers `x`, `g` where it has the norm
/// prologue, `w` and `out`; scalars `tokens`, `n`, `k`, `x_stride`) on `x` [tokens, x_stride]
/// and weights `w` of `n` rows by `k`: its `out` buffer, poisoned before the launch, or what
/// the emulator reported.
pub fn try_run_matmul(
    kernel: &Kernel,
    x: Array,
    g: Option<&[f32]>,
    w: Array,
    dims: (usize, usize, usize, usize),
) -> Result<Array, EmuError> {
    let (mut bufs, scalars) = matmul_launch(kernel, x, g, w, dims);
    run(kernel, &mut bufs, &scalars)?;
    Ok(bufs.remove("out").expect("an out buffer"))
}

/// [`try_run_matmul`]'s launch, profiled: each shared array's traffic.
pub fn profile_matmul(
    kernel: &Kernel,
    x: Array,
    w: Array,
    dims: (usize, usize, usize, usize),
) -> Result<SharedTraffic, EmuError> {
    let (mut bufs, scalars) = matmul_launch(kernel, x, None, w, dims);
    run_profiled(kernel, &mut bufs, &scalars)
}

/// The buffers and scalars [`try_run_matmul`] launches with.
fn matmul_launch(
    kernel: &Kernel,
    x: Array,
    g: Option<&[f32]>,
    w: Array,
    (tokens, n, k, x_stride): (usize, usize, usize, usize),
) -> (HashMap<String, Array>, HashMap<String, Scalar>) {
    let mut bufs = HashMap::from([
        ("x".into(), x),
        ("w".into(), w),
        ("out".into(), Array::poisoned(Ty::F32, tokens * n)),
    ]);
    if let Some(g) = g {
        bufs.insert("g".into(), Array::f32(g));
    }
    let mut scalars = ints(&[
        ("tokens", tokens as i64),
        ("n", n as i64),
        ("k", k as i64),
        ("x_stride", x_stride as i64),
    ]);
    // A GEMM that can split K, in one piece: it writes `out` and leaves the partials alone.
    if kernel.param("splits").is_some() {
        scalars.insert("splits".into(), Scalar::Int(1));
        bufs.insert("partial".into(), Array::poisoned(Ty::F32, 1));
    }
    (bufs, scalars)
}

/// A split-K GEMM in `splits` pieces and the reduction after it (`reduce`): the output. `g`:
/// the norm weight of a GEMM with a norm prologue.
pub fn try_run_split_matmul(
    (kernel, reduce): (&Kernel, &Kernel),
    x: Array,
    g: Option<&[f32]>,
    w: Array,
    (tokens, n, k, x_stride): (usize, usize, usize, usize),
    splits: usize,
) -> Result<Array, EmuError> {
    let mut bufs = HashMap::from([
        ("x".into(), x),
        ("w".into(), w),
        ("out".into(), Array::poisoned(Ty::F32, tokens * n)),
        (
            "partial".into(),
            Array::poisoned(Ty::F32, prologue_norms::partial_len(splits * tokens * n, n)),
        ),
    ]);
    if let Some(g) = g {
        bufs.insert("g".into(), Array::f32(g));
    }
    let scalars = ints(&[
        ("tokens", tokens as i64),
        ("n", n as i64),
        ("k", k as i64),
        ("x_stride", x_stride as i64),
        ("splits", splits as i64),
        ("out_stride", n as i64),
        ("out_col", 0),
    ]);
    run(kernel, &mut bufs, &scalars)?;
    run(reduce, &mut bufs, &scalars)?;
    Ok(bufs.remove("out").expect("an out buffer"))
}

/// Weights as the tensor cores take them: bf16, rounded to nearest even.
pub fn bf16_array(values: &[f32]) -> Array {
    Array::bf16(&values.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>())
}

/// The inputs of a matmul with a residual prologue (`add_rms_norm_matmul`), random: `x` and
/// `b` (rows `strides` apart, summed by the kernel), the norm weight `g` and the weights `w`.
pub struct Residual {
    pub x: Vec<f32>,
    pub b: Vec<f32>,
    pub g: Vec<f32>,
    pub w: Vec<f32>,
    pub strides: (usize, usize),
}

impl Residual {
    /// For a matmul of `(tokens, n, k)`.
    pub fn random(rng: &mut Rng, (tokens, n, k): (usize, usize, usize), strides: (usize, usize)) -> Self {
        Self {
            x: rng.vec(tokens * strides.0),
            b: rng.vec(tokens * strides.1),
            g: rng.vec(k),
            w: rng.vec(n * k),
            strides,
        }
    }
}

/// Run a matmul with a residual prologue on `inputs` (its weights given as `w`: f32 or bf16),
/// `n` weight rows by `k`, in `splits` pieces summed by `reduce` where given: `out`
/// (`[sum | product]` rows, `k + cols` wide; `cols` is `n`, or `n / 2` under a GLU
/// epilogue), poisoned before the launch.
pub fn try_run_residual_matmul(
    (kernel, reduce): (&Kernel, Option<&Kernel>),
    inputs: &Residual,
    w: Array,
    (tokens, n, k, cols): (usize, usize, usize, usize),
    splits: usize,
) -> Result<Array, EmuError> {
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&inputs.x)),
        ("b".into(), Array::f32(&inputs.b)),
        ("g".into(), Array::f32(&inputs.g)),
        ("w".into(), w),
        ("out".into(), Array::poisoned(Ty::F32, tokens * (k + cols))),
        (
            "partial".into(),
            Array::poisoned(Ty::F32, prologue_norms::partial_len(splits * tokens * n, n)),
        ),
    ]);
    let scalars = ints(&[
        ("tokens", tokens as i64),
        ("n", n as i64),
        ("k", k as i64),
        ("x_stride", inputs.strides.0 as i64),
        ("b_stride", inputs.strides.1 as i64),
        ("splits", splits as i64),
        ("out_stride", (k + cols) as i64),
        ("out_col", k as i64),
    ]);
    run(kernel, &mut bufs, &scalars)?;
    if let Some(reduce) = reduce {
        run(reduce, &mut bufs, &scalars)?;
    }
    Ok(bufs.remove("out").expect("an out buffer"))
}

/// `[a + b | rms_norm(a + b)·Wᵀ]` rows (`add_rms_norm_matmul`'s result) from the IR reference,
/// with the prologue's rounding: `round` applied to each summed element times its norm weight
/// and to the weights (identity for f32 kernels, bf16 for the tensor cores).
pub fn residual_reference(
    inputs: &Residual,
    (tokens, n, k): (usize, usize, usize),
    round: fn(f32) -> f32,
    offset: f32,
    eps: f32,
) -> Vec<f32> {
    let mut want = Vec::with_capacity(tokens * (k + n));
    for t in 0..tokens {
        let a = &inputs.x[t * inputs.strides.0..][..k];
        let b = &inputs.b[t * inputs.strides.1..][..k];
        let sum: Vec<f32> = a.iter().zip(b).map(|(a, b)| a + b).collect();
        let inv = 1.0 / (sum.iter().map(|v| v * v).sum::<f32>() / k as f32 + eps).sqrt();
        let scaled: Vec<f32> = sum
            .iter()
            .zip(&inputs.g)
            .map(|(v, g)| round(v * (g + offset)))
            .collect();
        want.extend(&sum);
        for r in 0..n {
            let dot: f32 = scaled
                .iter()
                .zip(&inputs.w[r * k..(r + 1) * k])
                .map(|(a, wv)| a * round(*wv))
                .sum();
            want.push(dot * inv);
        }
    }
    want
}

/// `body` with every statement, nested ones included, passed through `edit` (`None` drops
/// it): a template mutated to show the emulator catches what the mutation breaks.
pub fn edited(body: &[Stmt], edit: &dyn Fn(&Stmt) -> Option<Stmt>) -> Vec<Stmt> {
    body.iter()
        .filter_map(|s| match edit(s)? {
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => Some(Stmt::For {
                var,
                start,
                end,
                step,
                body: edited(&body, edit),
            }),
            Stmt::If { cond, then, otherwise } => Some(Stmt::If {
                cond,
                then: edited(&then, edit),
                otherwise: edited(&otherwise, edit),
            }),
            Stmt::Roles(r) => Some(Stmt::Roles(Box::new(Roles {
                roles: r
                    .roles
                    .iter()
                    .map(|role| Role {
                        cond: role.cond.clone(),
                        body: edited(&role.body, edit),
                    })
                    .collect(),
            }))),
            other => Some(other),
        })
        .collect()
}
