//! A drafter's vocabulary projection (the part of a draft step that grows with the
//! vocabulary) timed on the GPU, as a draft head's plan launches it: the full bf16 head and
//! its argmax against the 4-bit shortlist (a Q4_0 GEMV over every row, the best 64 picked in
//! one pass over the scores, those 64 rescored with the bf16 head, the best of them); and the
//! shortlist with its 64 picked by `top_k`'s rounds (one pass over the scores per candidate),
//! the selection the one-pass sort replaced. At the heads of Llama 3 8B, Qwen3.5 27B, an
//! EAGLE-3 head's 32 000-entry draft vocabulary for Llama 3 8B and a 262 144-entry Gemma
//! vocabulary, random weights made on the device. The candidates both
//! selections pick are checked against the host's `top_k` of the scores, read back.

use anyhow::{anyhow, bail, Result};
use ir::reference::ops;
use kernels_gen::dsl::{Kernel, Ty};
use kernels_gen::templates::gemv::{gemv, GemvSpec};
use kernels_gen::templates::quant::WeightFormat;
use kernels_gen::templates::{shortlist, top_k, top_k_sort};
use runtime::plan_exec::{DeviceArg, PlanDevice};
use runtime::random_weights::{fill_on_device, Fill};

/// The candidates a shortlist rescores (`passes::shortlisted_draft_head`'s).
const CANDIDATES: usize = 64;
/// Rows a draft step projects: one sequence drafting, and four.
const BATCHES: [usize; 2] = [1, 4];

/// A vocabulary head: its name, rows (the vocabulary) and width (the hidden size).
#[derive(Debug, Clone, Copy)]
pub struct Head {
    pub name: &'static str,
    pub vocab: usize,
    pub d: usize,
}

/// The heads the table times: two served shapes, an EAGLE-3 head's draft vocabulary for Llama
/// 3 8B (32 000 rows: what its drafts are scored over in place of the 128 256), and Gemma's
/// 262 144 rows at Gemma 3 270M's width, where the head is most of a small drafter's step.
pub fn heads() -> Vec<Head> {
    let of = |name, c: models::ModelConfig| Head {
        name,
        vocab: c.vocab_size,
        d: c.hidden,
    };
    vec![
        of("Llama-3-8B", models::ModelConfig::llama3_8b()),
        of("Qwen3.5-27B", models::ModelConfig::qwen3_5_27b()),
        Head {
            name: "Llama-3-8B EAGLE-3 draft vocabulary",
            vocab: 32_000,
            d: models::ModelConfig::llama3_8b().hidden,
        },
        Head {
            name: "Gemma 3 270M",
            vocab: 262_144,
            d: 640,
        },
    ]
}

impl Head {
    fn q4_bytes(&self) -> usize {
        self.vocab * self.d / 32 * 18
    }

    /// Every kernel the head's launches take, named as the table's launches name them.
    pub fn kernels(&self) -> Vec<Kernel> {
        let bf16 = GemvSpec::decode(WeightFormat::Dense(Ty::Bf16), self.d).with_x_vectors();
        let q4 = GemvSpec::decode(WeightFormat::Blocks(ir::DType::Q4_0), self.d);
        let mut kernels = vec![
            gemv("head_gemv", "gpu-check", bf16),
            gemv("head_gemv_prefill", "gpu-check", bf16.prefill()),
            top_k::top_k("argmax", "gpu-check"),
            gemv("shortlist_coarse", "gpu-check", q4),
            top_k::top_k("top_k_rounds", "gpu-check"),
            shortlist::rescore("shortlist_rescore", "gpu-check", WeightFormat::Dense(Ty::Bf16)),
            shortlist::best("shortlist_best", "gpu-check"),
        ];
        for (n, pass) in top_k_sort::passes(self.vocab, CANDIDATES).iter().enumerate() {
            kernels.push(match n {
                0 => top_k_sort::chunks(&sort_kernel(n), "gpu-check", pass.len),
                _ => top_k_sort::merge(&sort_kernel(n), "gpu-check", pass.len),
            });
        }
        kernels
    }
}

/// The name of the one-pass top-k's `n`th kernel.
fn sort_kernel(n: usize) -> String {
    match n {
        0 => "top_k_chunks".into(),
        _ => format!("top_k_merge_{n}"),
    }
}

/// One launch: kernel, grid, block, arguments.
type Launch<'a, B> = (String, u32, u32, Vec<DeviceArg<'a, B>>);

/// Seconds a sequence of launches takes on a device (or, off a GPU, anything).
pub type Timer<'t, D> = dyn FnMut(&mut D, &[Launch<'_, <D as PlanDevice>::Buffer>]) -> Result<f64> + 't;

/// A head's buffers on the device.
struct Buffers<B> {
    h: B,
    w: B,
    w4: B,
    logits: B,
    coarse: B,
    keys: [B; 2],
    ids: [B; 2],
    candidates: B,
    exact: B,
    tokens: B,
}

/// The launches of one way of drafting a token for each of `batch` rows: (the full head,
/// the shortlist by sorting, the shortlist by rounds), and the selections alone (sorting,
/// rounds).
struct Ways<'a, B> {
    full: Vec<Launch<'a, B>>,
    sorted: Vec<Launch<'a, B>>,
    rounds: Vec<Launch<'a, B>>,
    sort_alone: Vec<Launch<'a, B>>,
    rounds_alone: Vec<Launch<'a, B>>,
}

fn launch<'a, B>(kernels: &[Kernel], name: &str, args: Vec<(&str, DeviceArg<'a, B>)>) -> Result<Launch<'a, B>> {
    let kernel = kernels
        .iter()
        .find(|k| k.name == name)
        .ok_or_else(|| anyhow!("no kernel {name}"))?;
    let value = |param: &str| args.iter().find(|(n, _)| *n == param).map(|(_, v)| v.clone());
    let scalar = |param: &str| match value(param) {
        Some(DeviceArg::I32(v)) => Some(v as i64),
        _ => None,
    };
    let grid = kernel.grid.eval_int(&scalar).map_err(|e| anyhow!("{name}: {e}"))?;
    let bound = super::llama_8b::bind(kernel, value)?;
    Ok((name.to_string(), grid as u32, kernel.block_dim, bound))
}

fn ways<'a, B>(head: &Head, kernels: &[Kernel], b: &'a Buffers<B>, batch: usize) -> Result<Ways<'a, B>> {
    let (vocab, d, c) = (head.vocab, head.d, CANDIDATES);
    let whole = |buffer: &'a B, bytes: usize| DeviceArg::Buffer(buffer, 0..bytes);
    let int = |v: usize| DeviceArg::I32(v as i32);
    let h = || ("x", whole(&b.h, batch * d * 4));
    let gemv_name = if batch == 1 { "head_gemv" } else { "head_gemv_prefill" };
    let matmul = |name: &str, w: DeviceArg<'a, B>, out: &'a B| {
        let args = vec![
            h(),
            ("w", w),
            ("out", whole(out, batch * vocab * 4)),
            ("tokens", int(batch)),
            ("n", int(vocab)),
            ("k", int(d)),
            ("x_stride", int(d)),
        ];
        launch(kernels, name, args)
    };
    // `top_k`'s rounds: the best `k` of each row of `scores` into `out`.
    let rounds = |name: &str, scores: &'a B, out: &'a B, k: usize| {
        let args = vec![
            ("logits", whole(scores, batch * vocab * 4)),
            ("out", whole(out, batch * k * 4)),
            ("rows", int(batch)),
            ("v", int(vocab)),
            ("k", int(k)),
        ];
        launch(kernels, name, args)
    };
    let full = vec![
        matmul(gemv_name, whole(&b.w, vocab * d * 2), &b.logits)?,
        rounds("argmax", &b.logits, &b.tokens, 1)?,
    ];
    let coarse = matmul("shortlist_coarse", whole(&b.w4, head.q4_bytes()), &b.coarse)?;
    let passes = top_k_sort::passes(vocab, c);
    let mut sort_alone = Vec::new();
    for (n, pass) in passes.iter().enumerate() {
        let list_bytes = |lists: usize| batch * lists * c * 4;
        let out_ids = match n + 1 == passes.len() {
            true => whole(&b.candidates, batch * c * 4),
            false => whole(&b.ids[n % 2], list_bytes(pass.lists_out)),
        };
        let mut args = vec![
            ("out_keys", whole(&b.keys[n % 2], list_bytes(pass.lists_out))),
            ("out_ids", out_ids),
            ("rows", int(batch)),
            ("k", int(c)),
            ("lists_out", int(pass.lists_out)),
        ];
        args.extend(match n {
            0 => vec![("logits", whole(&b.coarse, batch * vocab * 4)), ("v", int(vocab))],
            _ => vec![
                ("in_keys", whole(&b.keys[(n - 1) % 2], list_bytes(pass.lists_in))),
                ("in_ids", whole(&b.ids[(n - 1) % 2], list_bytes(pass.lists_in))),
                ("lists_in", int(pass.lists_in)),
            ],
        });
        sort_alone.push(launch(kernels, &sort_kernel(n), args)?);
    }
    let rounds_alone = vec![rounds("top_k_rounds", &b.coarse, &b.candidates, c)?];
    let rescore_and_pick = vec![
        launch(
            kernels,
            "shortlist_rescore",
            vec![
                ("h", whole(&b.h, batch * d * 4)),
                ("w", whole(&b.w, vocab * d * 2)),
                ("candidates", whole(&b.candidates, batch * c * 4)),
                ("out", whole(&b.exact, batch * c * 4)),
                ("items", int(batch * c)),
                ("c", int(c)),
                ("k", int(d)),
                ("h_stride", int(d)),
            ],
        )?,
        launch(
            kernels,
            "shortlist_best",
            vec![
                ("scores", whole(&b.exact, batch * c * 4)),
                ("candidates", whole(&b.candidates, batch * c * 4)),
                ("out", whole(&b.tokens, batch * 4)),
                ("rows", int(batch)),
                ("c", int(c)),
            ],
        )?,
    ];
    let shortlist =
        |select: &[Launch<'a, B>]| [vec![coarse.clone()], select.to_vec(), rescore_and_pick.clone()].concat();
    Ok(Ways {
        full,
        sorted: shortlist(&sort_alone),
        rounds: shortlist(&rounds_alone),
        sort_alone,
        rounds_alone,
    })
}

/// What one batch of a head measured (seconds per draft step's projection).
#[derive(Debug, Clone, Copy)]
pub struct HeadTiming {
    pub batch: usize,
    pub full: f64,
    pub sorted: f64,
    pub rounds: f64,
    pub sort_alone: f64,
    pub rounds_alone: f64,
    /// Rows whose shortlisted token is the full head's.
    pub same_token: usize,
}

fn run_all<D: PlanDevice>(device: &mut D, launches: &[Launch<'_, D::Buffer>]) -> runtime::Result<()> {
    launches
        .iter()
        .try_for_each(|(kernel, grid, block, args)| device.launch(kernel, *grid, *block, args))
}

fn read_ints<D: PlanDevice>(device: &mut D, buffer: &D::Buffer, count: usize) -> Result<Vec<i32>> {
    let bytes = device.read(buffer, 0..count * 4)?;
    Ok(bytes
        .chunks(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// `head`'s ways of drafting on `device` (which holds [`Head::kernels`] and the fill kernels)
/// at each of `batches`, each timed by `time`; fails where a selection's candidates are not
/// the host's top 64 of the scores.
pub fn compare<D: PlanDevice>(
    device: &mut D,
    head: &Head,
    batches: &[usize],
    time: &mut Timer<'_, D>,
) -> Result<Vec<HeadTiming>> {
    let (vocab, d, c) = (head.vocab, head.d, CANDIDATES);
    let rows = batches.iter().copied().max().unwrap_or(1);
    let kernels = head.kernels();
    let lists = top_k_sort::passes(vocab, c)[0].lists_out;
    let mut alloc = |bytes: usize| device.alloc(bytes.max(4));
    let b = Buffers {
        h: alloc(rows * d * 4)?,
        w: alloc(vocab * d * 2)?,
        w4: alloc(head.q4_bytes())?,
        logits: alloc(rows * vocab * 4)?,
        coarse: alloc(rows * vocab * 4)?,
        keys: [alloc(rows * lists * c * 4)?, alloc(rows * lists * c * 4)?],
        ids: [alloc(rows * lists * c * 4)?, alloc(rows * lists * c * 4)?],
        candidates: alloc(rows * c * 4)?,
        exact: alloc(rows * c * 4)?,
        tokens: alloc(rows * 4)?,
    };
    fill_on_device(device, &b.h, 0, rows * d, Ty::F32, Fill::of(1, "h", &[rows, d]))?;
    fill_on_device(device, &b.w, 0, vocab * d, Ty::Bf16, Fill::of(2, "head", &[vocab, d]))?;
    // The 4-bit copy's blocks as random bytes: bf16 values of magnitude below 1 read as
    // finite f16 block scales.
    let w4_halves = head.q4_bytes() / 2;
    fill_on_device(
        device,
        &b.w4,
        0,
        w4_halves,
        Ty::Bf16,
        Fill::of(3, "head_q4", &[w4_halves, 1]),
    )?;
    let mut out = Vec::new();
    for &batch in batches {
        let ways = ways(head, &kernels, &b, batch)?;
        run_all(device, &ways.full)?;
        let full_tokens = read_ints(device, &b.tokens, batch)?;
        // The selections' candidates against the host's top 64 of the scores they read.
        run_all(device, &ways.sorted)?;
        let sorted_tokens = read_ints(device, &b.tokens, batch)?;
        let scores = device.read(&b.coarse, 0..batch * vocab * 4)?;
        let scores: Vec<f32> = scores
            .chunks(4)
            .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
            .collect();
        let want: Vec<i32> = (0..batch)
            .flat_map(|r| ops::top_k(&scores[r * vocab..(r + 1) * vocab], c))
            .map(|i| i as i32)
            .collect();
        for (how, select) in [("one-pass sort", &ways.sort_alone), ("rounds", &ways.rounds_alone)] {
            run_all(device, select)?;
            if read_ints(device, &b.candidates, batch * c)? != want {
                bail!("{}: the {how} top {c} of the 4-bit scores is not the host's", head.name);
            }
        }
        out.push(HeadTiming {
            batch,
            full: time(device, &ways.full)?,
            sorted: time(device, &ways.sorted)?,
            rounds: time(device, &ways.rounds)?,
            sort_alone: time(device, &ways.sort_alone)?,
            rounds_alone: time(device, &ways.rounds_alone)?,
            same_token: full_tokens.iter().zip(&sorted_tokens).filter(|(a, b)| a == b).count(),
        });
    }
    Ok(out)
}

/// The table: every head at [`BATCHES`], on the GPU `arch`.
pub fn draft_head_timings(arch: &str) -> Result<String> {
    let mut table = String::from(
        "| head | rows | full bf16 head + argmax µs | 4-bit shortlist µs | shortlist / full | \
         its top 64: one pass µs | by 64 rounds µs | shortlist with rounds µs | same token |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for head in heads() {
        let kernels = [head.kernels(), runtime::random_weights::fill_kernels()].concat();
        let mut device = super::compile_device(&kernels, arch)?;
        // Each launch's own time: programmatic launches would overlap the repetitions.
        device.set_programmatic_launch(false);
        let mut time = |d: &mut runtime_cuda::CudaDevice, launches: &[Launch<'_, _>]| -> Result<f64> {
            Ok(d.time(20, |d| run_all(d, launches))?)
        };
        for t in compare(&mut device, &head, &BATCHES, &mut time)? {
            table += &format!(
                "| {} {}×{} | {} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} | {}/{} |\n",
                head.name,
                head.vocab,
                head.d,
                t.batch,
                t.full * 1e6,
                t.sorted * 1e6,
                t.sorted / t.full,
                t.sort_alone * 1e6,
                t.rounds_alone * 1e6,
                t.rounds * 1e6,
                t.same_token,
                t.batch
            );
        }
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use runtime::emulator_device::EmulatorDevice;

    /// The table's launches on the emulator at a small head: every kernel finds its
    /// arguments and grid, the sort's merge reads what its chunks wrote, and both selections
    /// pick the host's candidates.
    #[test]
    fn the_draft_head_table_runs_every_way_on_the_emulator() {
        let head = Head {
            name: "small",
            vocab: 5000,
            d: 64,
        };
        assert_eq!(top_k_sort::passes(head.vocab, CANDIDATES).len(), 2);
        let kernels = [head.kernels(), runtime::random_weights::fill_kernels()].concat();
        let mut device = EmulatorDevice::new(kernels);
        let mut launched = 0;
        let mut count = |_: &mut EmulatorDevice, launches: &[Launch<'_, _>]| -> Result<f64> {
            launched += launches.len();
            Ok(1.0)
        };
        let timings = compare(&mut device, &head, &[1, 2], &mut count).unwrap();
        assert_eq!(timings.len(), 2);
        // Per batch: 2 (full) + 5 (coarse, chunks, merge, rescore, best) + 4 + 2 + 1.
        assert_eq!(launched, 2 * 14);
    }
}
