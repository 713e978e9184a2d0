//! Attention alone on the GPU, a Llama-8B-shaped layer (32 query heads, 8 KV heads of 128
//! dims, bf16 cache with random contents made on the device): one sequence's prefill at 512,
//! 2 048 and 8 192 tokens by the tensor-core kernel (`flash_attention`) over a contiguous cache
//! (and over an FP8 one and a half one) and over the paged pool as the serving plans launch it
//! (the step's query tiles), on Hopper also on `wgmma` (`flash_attention_wgmma`, each
//! schedule) both ways, in lockstep over the FP8 cache and by TMA over the half one, on the
//! B200 also on `tcgen05` (`flash_attention_tcgen05`, copying or loading by TMA) both ways,
//! copying over the FP8 cache and by TMA over the half one, and by
//! the split attention (split pass and merge, what decode steps take; the scalar pass and the
//! vector one), in µs and TFLOP/s; and a decode step of 64 sequences at 4 096 positions over
//! the paged pool, as the serving plans run it (either pass, over the bf16 cache and over an
//! FP8 one), in GB/s of cache read and its share of the copy bandwidth.

use anyhow::{anyhow, Result};
use kernels_gen::dsl::{Kernel, Ty};
use kernels_gen::templates::attention::{self, attention_combine, attention_split};
use kernels_gen::templates::attention_vector::{self, attention_split_vector};
use kernels_gen::templates::cache_layout::CacheLayout;
use kernels_gen::templates::fill::{fill_kernel, fill_uniform};
use kernels_gen::templates::flash_attention::{self, flash_attention, flash_attention_over, Masking};
use kernels_gen::templates::flash_attention_tcgen05::{flash_attention_tcgen05, flash_attention_tcgen05_over, Loads};
use kernels_gen::templates::flash_attention_wgmma::{
    self, flash_attention_wgmma, flash_attention_wgmma_over, Schedule,
};
use runtime::plan_exec::{DeviceArg, PlanDevice};
use runtime::random_weights::{fill_kernels, fill_on_device, Fill};

const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
/// Prompt lengths the prefill is timed at.
const PROMPTS: [usize; 3] = [512, 2048, 8192];
/// The decode step: sequences, and the positions each has cached.
const DECODE: (usize, usize) = (64, 4096);
/// Positions a block of the paged pool holds.
const BLOCK_SIZE: usize = 16;

/// The `wgmma` prefill's kernels (Hopper): each schedule's over a contiguous cache and over
/// the pool (by TMA too), with the table's label.
const WGMMA_FLASH: [(&str, &str, Schedule, bool); 6] = [
    (
        "flash_attention_wgmma",
        "wgmma (flash_attention_wgmma)",
        Schedule::Lockstep,
        false,
    ),
    (
        "flash_attention_wgmma_pool",
        "wgmma over the pool",
        Schedule::Lockstep,
        true,
    ),
    (
        "flash_attention_wgmma_specialised",
        "wgmma, warp-specialised",
        Schedule::Specialised,
        false,
    ),
    (
        "flash_attention_wgmma_specialised_pool",
        "wgmma, warp-specialised, over the pool",
        Schedule::Specialised,
        true,
    ),
    (
        "flash_attention_wgmma_tma",
        "wgmma, warp-specialised, loading by TMA",
        Schedule::Tma,
        false,
    ),
    (
        "flash_attention_wgmma_tma_pool",
        "wgmma, loading by TMA, over the pool",
        Schedule::Tma,
        true,
    ),
];

/// The query rows a block of the `wgmma` and `tcgen05` prefills takes.
const WIDE_TILE_ROWS: usize = flash_attention_wgmma::QUERY_TILE_ROWS;
const _: () = assert!(kernels_gen::templates::flash_attention_tcgen05::QUERY_TILE_ROWS == WIDE_TILE_ROWS);

/// The `tcgen05` prefill's kernels (the B200): over a contiguous cache and over the pool, the
/// tiles copied or loaded by TMA, with the table's label.
const TCGEN05_FLASH: [(&str, &str, Loads, bool); 4] = [
    (
        "flash_attention_tcgen05",
        "tcgen05 (flash_attention_tcgen05)",
        Loads::Copies,
        false,
    ),
    (
        "flash_attention_tcgen05_pool",
        "tcgen05 over the pool",
        Loads::Copies,
        true,
    ),
    (
        "flash_attention_tcgen05_tma",
        "tcgen05, loading by TMA",
        Loads::Tma,
        false,
    ),
    (
        "flash_attention_tcgen05_tma_pool",
        "tcgen05, loading by TMA, over the pool",
        Loads::Tma,
        true,
    ),
];

/// The caches of other elements the prompts are timed over too (`--kv-cache-dtype`), each
/// with its kernels' name suffix, its label, and how Hopper's `wgmma` and the B200's
/// `tcgen05` run over it: FP8 codes (each tile widened to bf16 once; `wgmma` in lockstep,
/// `tcgen05` copying) and halves (multiplied as halves, loaded by TMA).
const OTHER_CACHES: [(Ty, &str, &str, Schedule, Loads); 2] = [
    (Ty::F8E4M3, "fp8", "an FP8 cache", Schedule::Lockstep, Loads::Copies),
    (Ty::F16, "f16", "a half cache", Schedule::Tma, Loads::Tma),
];

/// The kernels timed on `arch`: the tensor-core prefill over a contiguous cache and over the
/// batched paged pool (on Hopper also on `wgmma`, on the B200 on `tcgen05`), both split passes
/// over both, and the merge.
fn kernels(arch: &str) -> Vec<Kernel> {
    let group = attention::heads_per_block(HEADS, KV_HEADS, HEAD_DIM);
    let vector_group = attention_vector::heads_per_block(HEADS, KV_HEADS, HEAD_DIM, Ty::Bf16);
    let wgmma = WGMMA_FLASH
        .iter()
        .filter(|_| arch == "sm_90a")
        .map(|&(name, _, schedule, pooled)| {
            flash_attention_wgmma(name, "gpu-check", pool_or_not(pooled), HEAD_DIM, schedule)
        });
    let tcgen05 = TCGEN05_FLASH
        .iter()
        .filter(|_| arch == "sm_100a")
        .map(|&(name, _, loads, pooled)| {
            flash_attention_tcgen05(name, "gpu-check", pool_or_not(pooled), HEAD_DIM, loads)
        });
    let mut kernels = vec![
        flash_attention(
            "flash_attention",
            "gpu-check",
            CacheLayout::Contiguous,
            HEAD_DIM,
            Masking::CutTiles,
        ),
        flash_attention(
            "flash_attention_pool",
            "gpu-check",
            CacheLayout::Batched,
            HEAD_DIM,
            Masking::CutTiles,
        ),
        attention_split(
            "attention",
            "gpu-check",
            CacheLayout::Contiguous,
            HEAD_DIM,
            group,
            Ty::Bf16,
        ),
        attention_split(
            "attention_batched",
            "gpu-check",
            CacheLayout::Batched,
            HEAD_DIM,
            group,
            Ty::Bf16,
        ),
        attention_split_vector(
            "attention_vector",
            "gpu-check",
            CacheLayout::Contiguous,
            HEAD_DIM,
            vector_group,
            Ty::Bf16,
        ),
        attention_split_vector(
            "attention_vector_batched",
            "gpu-check",
            CacheLayout::Batched,
            HEAD_DIM,
            vector_group,
            Ty::Bf16,
        ),
        attention_combine("attention_combine", "gpu-check", HEAD_DIM),
        // The decode step over an FP8 cache (`--kv-cache-dtype fp8`).
        attention_split(
            "attention_batched_fp8",
            "gpu-check",
            CacheLayout::Batched,
            HEAD_DIM,
            group,
            Ty::F8E4M3,
        ),
        attention_split_vector(
            "attention_vector_batched_fp8",
            "gpu-check",
            CacheLayout::Batched,
            HEAD_DIM,
            attention_vector::heads_per_block(HEADS, KV_HEADS, HEAD_DIM, Ty::F8E4M3),
            Ty::F8E4M3,
        ),
    ];
    kernels.extend(wgmma);
    kernels.extend(tcgen05);
    // Prompts over the other caches: on `mma.sync`, and on the target's own tensor cores.
    for (cache, suffix, _, schedule, loads) in OTHER_CACHES {
        let (layout, head) = (CacheLayout::Contiguous, (HEAD_DIM, cache));
        let name = |family: &str| format!("{family}_{suffix}");
        kernels.push(flash_attention_over(
            &name("flash_attention"),
            "gpu-check",
            layout,
            head,
            Masking::CutTiles,
        ));
        kernels.extend(match arch {
            "sm_90a" => Some(flash_attention_wgmma_over(
                &name("flash_attention_wgmma"),
                "gpu-check",
                layout,
                head,
                schedule,
            )),
            "sm_100a" => Some(flash_attention_tcgen05_over(
                &name("flash_attention_tcgen05"),
                "gpu-check",
                layout,
                head,
                loads,
            )),
            _ => None,
        });
    }
    kernels
}

/// The batched pool's layout, or a contiguous cache.
fn pool_or_not(pooled: bool) -> CacheLayout {
    match pooled {
        true => CacheLayout::Batched,
        false => CacheLayout::Contiguous,
    }
}

/// The timings as markdown.
pub fn attention_timings(arch: &str, bandwidth: f64) -> Result<String> {
    let kernels = kernels(arch);
    let fills = [
        fill_kernels(),
        OTHER_CACHES
            .map(|(ty, ..)| fill_uniform(fill_kernel(ty), "gpu-check", ty))
            .to_vec(),
    ];
    let mut device = super::compile_device(&[kernels.clone(), fills.concat()].concat(), arch)?;
    device.set_programmatic_launch(false);
    let find = |name: &str| {
        kernels
            .iter()
            .find(|k| k.name == name)
            .ok_or_else(|| anyhow!("no kernel {name}"))
    };
    let (flash, flash_pool, split, vector, combine) = (
        find("flash_attention")?,
        find("flash_attention_pool")?,
        find("attention")?,
        find("attention_vector")?,
        find("attention_combine")?,
    );
    let most = *PROMPTS.iter().max().expect("prompt lengths");
    let (sequences, positions) = DECODE;
    let cache_rows = most.max(sequences * positions);
    let kv = cache_rows * KV_HEADS * HEAD_DIM;
    let k = device.alloc(kv * 2)?;
    let v = device.alloc(kv * 2)?;
    fill_on_device(
        &mut device,
        &k,
        0,
        kv,
        Ty::Bf16,
        Fill::of(5, "k", &[cache_rows, KV_HEADS * HEAD_DIM]),
    )?;
    fill_on_device(
        &mut device,
        &v,
        0,
        kv,
        Ty::Bf16,
        Fill::of(6, "v", &[cache_rows, KV_HEADS * HEAD_DIM]),
    )?;
    let q_len = most * HEADS * HEAD_DIM;
    let q = device.alloc(q_len * 4)?;
    fill_on_device(
        &mut device,
        &q,
        0,
        q_len,
        Ty::F32,
        Fill::of(7, "q", &[most, HEADS * HEAD_DIM]),
    )?;
    let out = device.alloc(q_len * 4)?;
    let partial_len = attention::partial_len(most, HEADS, HEAD_DIM);
    let partial = device.alloc(partial_len * 4)?;
    // The decode step's paged pool: sequence s holds positions 0..4096 in blocks s·256.., its
    // one row at position 4095.
    let per_sequence = positions / BLOCK_SIZE;
    let ints = |values: Vec<i32>| values.into_iter().flat_map(i32::to_le_bytes).collect::<Vec<u8>>();
    let tables = device.upload(&ints((0..(sequences * per_sequence) as i32).collect()))?;
    let row_table = device.upload(&ints((0..sequences as i32).map(|s| s * per_sequence as i32).collect()))?;
    let row_pos = device.upload(&ints(vec![positions as i32 - 1; sequences]))?;
    // The prompt over the pool: one sequence in blocks 0.., its rows at positions 0...
    let prompt_tables = device.upload(&ints((0..most.div_ceil(BLOCK_SIZE) as i32).collect()))?;
    let prompt_row_table = device.upload(&ints(vec![0; most]))?;
    let prompt_row_pos = device.upload(&ints((0..most as i32).collect()))?;
    let buffers = AttentionBuffers {
        q: (&q, q_len * 4),
        k: (&k, kv * 2),
        v: (&v, kv * 2),
        out: (&out, q_len * 4),
        partial: (&partial, partial_len * 4),
        block_tables: (&tables, sequences * per_sequence * 4),
        row_table: (&row_table, sequences * 4),
        row_pos: (&row_pos, sequences * 4),
        query_tiles: None,
        seqs: sequences,
        cache_rows,
    };
    // The same cache in FP8 and in halves (`--kv-cache-dtype fp8`, `f16`).
    let mut other_caches = Vec::new();
    for (ty, ..) in OTHER_CACHES {
        let (k, v) = (device.alloc(kv * ty.bytes())?, device.alloc(kv * ty.bytes())?);
        for (buffer, seed, name) in [(&k, 5, "k"), (&v, 6, "v")] {
            let fill = Fill::of(seed, name, &[cache_rows, KV_HEADS * HEAD_DIM]);
            fill_on_device(&mut device, buffer, 0, kv, ty, fill)?;
        }
        other_caches.push((k, v));
    }
    let other_buffers: Vec<_> = other_caches
        .iter()
        .zip(OTHER_CACHES)
        .map(|((k, v), (ty, ..))| AttentionBuffers {
            k: (k, kv * ty.bytes()),
            v: (v, kv * ty.bytes()),
            ..buffers
        })
        .collect();
    // The decode step's FP8 rows read the FP8 cache.
    let fp8 = OTHER_CACHES
        .iter()
        .position(|(ty, ..)| *ty == Ty::F8E4M3)
        .map(|at| &other_buffers[at])
        .expect("an FP8 cache among the others");
    let mut table = String::from(
        "| attention | rows | kernel | µs | TFLOP/s | cache GB/s | % of copy bandwidth |\n|---|---|---|---|---|---|---|\n",
    );
    for tokens in PROMPTS {
        let value = |name: &str| buffers.value(name, tokens);
        // Causal: row t sees t + 1 keys; two matmuls of 2·head_dim flops a (row, key, head).
        let flops = 4.0 * (HEADS * HEAD_DIM) as f64 * (tokens * (tokens + 1) / 2) as f64;
        // The step's query tiles as each tensor-core kernel over the pool cuts them: 64 rows
        // on `mma.sync`, 128 on `wgmma` and `tcgen05`.
        let tiles_bytes = |tile_rows| ints(flash_attention::query_tiles(&[tokens], tile_rows));
        let (tiles, wide_tiles) = (
            tiles_bytes(flash_attention::QUERY_TILE_ROWS),
            tiles_bytes(WIDE_TILE_ROWS),
        );
        let (query_tiles, wide_query_tiles) = (device.upload(&tiles)?, device.upload(&wide_tiles)?);
        let pool = |query_tiles| AttentionBuffers {
            block_tables: (&prompt_tables, most.div_ceil(BLOCK_SIZE) * 4),
            row_table: (&prompt_row_table, most * 4),
            row_pos: (&prompt_row_pos, most * 4),
            query_tiles: Some(query_tiles),
            seqs: 1,
            ..buffers
        };
        let (pool, wide_pool) = (
            pool((&query_tiles, tiles.len())),
            pool((&wide_query_tiles, wide_tiles.len())),
        );
        let over_pool = |name: &str| pool.value(name, tokens);
        let over_wide_pool = |name: &str| wide_pool.value(name, tokens);
        type Value<'a, 'b> =
            &'b dyn Fn(&str) -> Option<DeviceArg<'a, <runtime_cuda::CudaDevice as PlanDevice>::Buffer>>;
        // (label, kernels, their arguments)
        let mut launches: Vec<(String, Vec<&Kernel>, Value)> = vec![
            ("tensor cores (flash_attention)".into(), vec![flash], &value),
            (
                "tensor cores over the pool (the plans')".into(),
                vec![flash_pool],
                &over_pool,
            ),
            (
                "split pass + merge (decode steps')".into(),
                vec![split, combine],
                &value,
            ),
            ("vector split pass + merge".into(), vec![vector, combine], &value),
        ];
        let over_others: Vec<_> = other_buffers
            .iter()
            .map(|buffers| move |name: &str| buffers.value(name, tokens))
            .collect();
        for ((_, suffix, label, ..), over) in OTHER_CACHES.iter().zip(&over_others) {
            for (family, on) in [
                ("flash_attention", "tensor cores"),
                ("flash_attention_wgmma", "wgmma"),
                ("flash_attention_tcgen05", "tcgen05"),
            ] {
                if let Ok(kernel) = find(&format!("{family}_{suffix}")) {
                    launches.push((format!("{on} over {label}"), vec![kernel], over));
                }
            }
        }
        let wide = WGMMA_FLASH
            .iter()
            .map(|&(name, label, _, pooled)| (name, label, pooled))
            .chain(
                TCGEN05_FLASH
                    .iter()
                    .map(|&(name, label, _, pooled)| (name, label, pooled)),
            );
        for (name, label, pooled) in wide {
            if let Ok(kernel) = find(name) {
                let value: Value = match pooled {
                    true => &over_wide_pool,
                    false => &value,
                };
                launches.push((label.into(), vec![kernel], value));
            }
        }
        for (label, launched, value) in launches {
            let seconds = time_launches(&mut device, &launched, value)?;
            table += &format!(
                "| prefill, one sequence | {tokens} | {label} | {:.1} | {:.1} | – | – |\n",
                seconds * 1e6,
                flops / seconds / 1e12
            );
        }
    }
    let value = |name: &str| buffers.value(name, sequences);
    // Every sequence's keys and values, once.
    let elements = sequences * positions * KV_HEADS * HEAD_DIM * 2;
    for (label, pass) in [
        ("split pass + merge (the plans')", "attention_batched"),
        ("vector split pass + merge", "attention_vector_batched"),
    ] {
        let seconds = time_launches(&mut device, &[find(pass)?, combine], &value)?;
        table += &decode_row(DECODE, label, seconds, (elements * 2) as f64, bandwidth);
    }
    // The same step over the FP8 cache: a byte a cached element, so half the bytes to read.
    let value = |name: &str| fp8.value(name, sequences);
    for (label, pass) in [
        ("split pass + merge, FP8 cache", "attention_batched_fp8"),
        ("vector split pass + merge, FP8 cache", "attention_vector_batched_fp8"),
    ] {
        let seconds = time_launches(&mut device, &[find(pass)?, combine], &value)?;
        table += &decode_row(DECODE, label, seconds, elements as f64, bandwidth);
    }
    Ok(table)
}

/// A decode step's row of the table: `bytes` of cache read in `seconds`, and as a share of
/// the copy `bandwidth`.
fn decode_row((sequences, positions): (usize, usize), label: &str, seconds: f64, bytes: f64, bandwidth: f64) -> String {
    format!(
        "| decode, {sequences} sequences × {positions} positions, paged | {sequences} | {label} | {:.1} | – | {:.0} | {:.0}% |\n",
        seconds * 1e6,
        bytes / seconds / 1e9,
        100.0 * bytes / seconds / bandwidth
    )
}

/// The buffers the timed attentions read and write, each with its length in bytes (the
/// query tiles where a step over the pool is timed on the tensor cores), and the sequences of
/// a step over the pool.
#[derive(Clone, Copy)]
struct AttentionBuffers<'a, B> {
    q: (&'a B, usize),
    k: (&'a B, usize),
    v: (&'a B, usize),
    out: (&'a B, usize),
    partial: (&'a B, usize),
    block_tables: (&'a B, usize),
    row_table: (&'a B, usize),
    row_pos: (&'a B, usize),
    query_tiles: Option<(&'a B, usize)>,
    seqs: usize,
    /// Positions the cache buffers hold.
    cache_rows: usize,
}

impl<'a, B> AttentionBuffers<'a, B> {
    /// The argument for parameter `name` of any kernel timed, at a step of `rows` rows (the
    /// prefill's from position 0, or the decode step's rows each of its own sequence).
    fn value(&self, name: &str, rows: usize) -> Option<DeviceArg<'a, B>> {
        let buffer = |(b, bytes): (&'a B, usize)| DeviceArg::Buffer(b, 0..bytes);
        let int = |v: usize| DeviceArg::I32(v as i32);
        Some(match name {
            "q" => buffer(self.q),
            "k" => buffer(self.k),
            "v" => buffer(self.v),
            "out" => buffer(self.out),
            "partial" => buffer(self.partial),
            "block_tables" => buffer(self.block_tables),
            "row_table" => buffer(self.row_table),
            "row_pos" => buffer(self.row_pos),
            "query_tiles" => buffer(self.query_tiles?),
            "seqs" => int(self.seqs),
            "block_size" => int(BLOCK_SIZE),
            "cache_rows" => int(self.cache_rows),
            "cache_width" => int(KV_HEADS * HEAD_DIM),
            "tokens" => int(rows),
            "q_stride" => int(HEADS * HEAD_DIM),
            "first" | "window" => int(0),
            "heads" => int(HEADS),
            "kv_heads" => int(KV_HEADS),
            "scale" => DeviceArg::F32(1.0 / (HEAD_DIM as f32).sqrt()),
            "splits" => int(attention::splits_for(rows)),
            _ => return None,
        })
    }
}

/// Device seconds of `launched` run in turn (each over its grid for `value`'s scalars), the
/// mean of 10 runs after one to warm up.
fn time_launches<'a>(
    device: &mut runtime_cuda::CudaDevice,
    launched: &[&Kernel],
    value: &dyn Fn(&str) -> Option<DeviceArg<'a, <runtime_cuda::CudaDevice as PlanDevice>::Buffer>>,
) -> Result<f64> {
    let scalar = |name: &str| match value(name) {
        Some(DeviceArg::I32(v)) => Some(v as i64),
        _ => None,
    };
    let mut plan = Vec::new();
    for kernel in launched {
        let args = super::llama_8b::bind(kernel, value)?;
        let grid = kernel
            .grid
            .eval_int(&scalar)
            .map_err(|e| anyhow!("{}: {e}", kernel.name))?;
        plan.push((kernel, grid as u32, args));
    }
    Ok(device.time(10, |d| {
        plan.iter()
            .try_for_each(|(kernel, grid, args)| d.launch(&kernel.name, *grid, kernel.block_dim, args))
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the attention table times finds all its arguments, and its grid.
    #[test]
    fn the_attention_table_binds_every_kernel() {
        let b = 0usize;
        let buffers = AttentionBuffers {
            q: (&b, 4),
            k: (&b, 4),
            v: (&b, 4),
            out: (&b, 4),
            partial: (&b, 4),
            block_tables: (&b, 4),
            row_table: (&b, 4),
            row_pos: (&b, 4),
            query_tiles: Some((&b, 4)),
            seqs: 1,
            cache_rows: 16,
        };
        let (hopper, blackwell) = (kernels("sm_90a"), kernels("sm_100a"));
        // Each also over the other caches on its tensor cores.
        let others = OTHER_CACHES.len();
        assert_eq!(hopper.len(), kernels("sm_120a").len() + WGMMA_FLASH.len() + others);
        assert_eq!(blackwell.len(), kernels("sm_120a").len() + TCGEN05_FLASH.len() + others);
        for kernel in [hopper, blackwell].concat() {
            let value = |name: &str| buffers.value(name, 512);
            if let Err(e) = super::super::llama_8b::bind(&kernel, value) {
                panic!("{e}");
            }
            let scalar = |name: &str| match value(name) {
                Some(DeviceArg::I32(v)) => Some(v as i64),
                _ => None,
            };
            assert!(kernel.grid.eval_int(&scalar).unwrap() > 0, "{}", kernel.name);
        }
    }
}
