//! `ldmatrix` on the emulator: the pairs each lane gets (the PTX ISA's layout, plain and
//! transposed), `mma.sync` on those pairs against a plain product (bf16 and f16 tiles), and the
//! misuse a GPU would run silently wrong.

use half::{bf16, f16};
use kernels_gen::dsl::*;
use kernels_gen::emulator::{run, run_profiled, Array, EmuError};
use kernels_gen::templates::mma_operands::{b_block, lane_offset, x4_names, Quad};
use std::collections::HashMap;

/// Rows and columns of the test tile, and its row pitch (16 bytes of padding a row).
const ROWS: i64 = 16;
const COLUMNS: i64 = 16;
const PITCH: i64 = COLUMNS + 8;

/// Element (r, c) of a tile of `ty`: exact in it, distinct. Those of an f16 tile take an eighth
/// more, which bf16's 8 bits would round off.
fn element_of(ty: Ty, r: i64, c: i64) -> f32 {
    let eighth = match ty {
        Ty::F16 => 0.125,
        _ => 0.0,
    };
    (r * COLUMNS + c) as f32 + eighth
}

/// One warp: the tile staged into shared `tile` from `x` (row-major, `COLUMNS` wide) at
/// `PITCH`, a barrier, then `body`.
fn tile_kernel(body: Vec<Stmt>, out: Ty) -> Kernel {
    tile_kernel_of(Ty::Bf16, body, out)
}

/// [`tile_kernel`] with a tile of `ty` (bf16 or f16).
fn tile_kernel_of(ty: Ty, body: Vec<Stmt>, out: Ty) -> Kernel {
    let staging = for_(
        "e",
        tid(),
        int(ROWS * COLUMNS),
        int(32),
        vec![store(
            "tile",
            var("e") / int(COLUMNS) * int(PITCH) + rem(var("e"), int(COLUMNS)),
            load("x", var("e")),
        )],
    );
    Kernel {
        name: "k".into(),
        origin: "test".into(),
        params: vec![buffer("x", Ty::F32, false), buffer("out", out, true)],
        shared: vec![SharedArray {
            name: "tile".into(),
            ty,
            len: (ROWS * PITCH) as usize,
        }],
        block_dim: 32,
        grid: int(1),
        body: [vec![staging, Stmt::SyncThreads], body].concat(),
    }
}

fn tile_values(ty: Ty) -> Vec<f32> {
    (0..ROWS)
        .flat_map(|r| (0..COLUMNS).map(move |c| element_of(ty, r, c)))
        .collect()
}

fn run_tile(k: &Kernel, out: (Ty, usize)) -> Result<Array, EmuError> {
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&tile_values(k.shared[0].ty))),
        ("out".into(), Array::poisoned(out.0, out.1)),
    ]);
    run(k, &mut bufs, &HashMap::new())?;
    Ok(bufs.remove("out").unwrap())
}

fn bits(ty: Ty, v: f32) -> i64 {
    match ty {
        Ty::F16 => f16::from_f32(v).to_bits() as i64,
        _ => bf16::from_f32(v).to_bits() as i64,
    }
}

/// Every lane's four pairs of an `ldmatrix.x4` over the tile (bf16 and f16: the pairs are the
/// elements' own bits), either quad, plain and transposed, against the PTX ISA's layout: lane
/// (g = l / 4, t = l % 4) of matrix i gets row g, columns 2t, 2t + 1 of it, or transposed
/// column g, rows 2t, 2t + 1.
#[test]
fn each_lane_gets_its_pairs() {
    for (ty, quad) in [Ty::Bf16, Ty::F16]
        .into_iter()
        .flat_map(|ty| [(ty, Quad::RowsThenColumns), (ty, Quad::ColumnsThenRows)])
    {
        for transpose in [false, true] {
            let names = x4_names("p", "");
            let mut body = vec![load_matrix("tile", lane_offset(quad, PITCH), &names, transpose)];
            for (i, n) in names.iter().enumerate() {
                body.push(store("out", tid() * int(4) + int(i as i64), var(n)));
            }
            let out = run_tile(&tile_kernel_of(ty, body, Ty::U32), (Ty::U32, 128))
                .unwrap()
                .to_i64()
                .unwrap();
            for lane in 0..32 {
                let (g, t) = (lane as i64 / 4, lane as i64 % 4);
                for i in 0..4 {
                    // Matrix i's corner in the tile.
                    let (low, high) = (i % 2, i / 2);
                    let (r0, c0) = match quad {
                        Quad::RowsThenColumns => (8 * low, 8 * high),
                        Quad::ColumnsThenRows => (8 * high, 8 * low),
                    };
                    let [lo, hi] = match transpose {
                        false => [(g, 2 * t), (g, 2 * t + 1)],
                        true => [(2 * t, g), (2 * t + 1, g)],
                    };
                    let at = |(r, c): (i64, i64)| bits(ty, element_of(ty, r0 + r, c0 + c));
                    let want = at(lo) | at(hi) << 16;
                    assert_eq!(
                        out[lane * 4 + i as usize],
                        want,
                        "{ty:?} {quad:?} transposed {transpose}: lane {lane}, matrix {i}"
                    );
                }
            }
        }
    }
}

/// `mma.sync` on pairs from `ldmatrix` computes what it computes on f32 fragments: A the
/// tile's 16×16, B (16×16, two 8-column blocks) the tile read K-major (`W[n, k]`, plain) and
/// read as its own rows (`B[k, n]`, transposed); each against the product in f64, over a bf16
/// tile and an f16 one (whose elements bf16 would round: the MMA takes them as halves).
#[test]
fn mma_on_loaded_pairs_multiplies_the_tile() {
    let a = x4_names("a", "");
    let b = x4_names("b", "");
    let cases = [Ty::Bf16, Ty::F16].into_iter().flat_map(|ty| [(ty, false), (ty, true)]);
    for (ty, transposed_b) in cases {
        let element = |r: i64, c: i64| element_of(ty, r, c);
        let quad = match transposed_b {
            false => Quad::ColumnsThenRows,
            true => Quad::RowsThenColumns,
        };
        let mut body = vec![
            load_matrix("tile", lane_offset(Quad::RowsThenColumns, PITCH), &a, false),
            load_matrix("tile", lane_offset(quad, PITCH), &b, transposed_b),
        ];
        for block in 0..2 {
            let c: [String; 4] = std::array::from_fn(|i| format!("c{block}_{i}"));
            body.extend(c.iter().map(|n| let_(n, Ty::F32, f(0.0))));
            body.push(Stmt::Mma(Box::new(MmaFragments {
                element: MmaElement::of(ty).unwrap(),
                a: MmaOperand::Pairs(a.clone()),
                b: b_block(&b, block),
                c: c.clone(),
            })));
            // C[g or g + 8][8·block + 2t, + 1].
            for (i, n) in c.iter().enumerate() {
                let row = lane() / int(4) + int(if i >= 2 { 8 } else { 0 });
                let col = rem(lane(), int(4)) * int(2) + int(8 * block as i64 + (i % 2) as i64);
                body.push(store("out", row * int(16) + col, var(n)));
            }
        }
        let out = run_tile(&tile_kernel_of(ty, body, Ty::F32), (Ty::F32, 256))
            .unwrap()
            .to_f32()
            .unwrap();
        for m in 0..16 {
            for n in 0..16 {
                let want: f64 = (0..16)
                    .map(|k| {
                        let b = match transposed_b {
                            false => element(n, k),
                            true => element(k, n),
                        };
                        element(m, k) as f64 * b as f64
                    })
                    .sum();
                let got = out[(m * 16 + n) as usize] as f64;
                assert!(
                    (got - want).abs() <= want * 1e-6,
                    "{ty:?}, B transposed {transposed_b}: C[{m}][{n}] {got} vs {want}"
                );
            }
        }
    }
}

/// Rows padded by 16 bytes put a matrix's 8 rows on 8 different 4-bank groups; rows of 32
/// bytes (no padding, 16 columns) put rows r and r + 4 on the same banks: 2 wavefronts a
/// matrix.
#[test]
fn bank_conflicts_are_counted_a_matrix_a_phase() {
    use kernels_gen::emulator::SharedTraffic;
    let traffic = |pitch: i64| -> SharedTraffic {
        let names = x4_names("p", "");
        let mut k = tile_kernel(
            vec![load_matrix(
                "tile",
                lane_offset(Quad::RowsThenColumns, pitch),
                &names,
                false,
            )],
            Ty::U32,
        );
        // Every element written, whatever the pitch the loads assume.
        k.body[0] = for_(
            "e",
            tid(),
            int(ROWS * PITCH),
            int(32),
            vec![store("tile", var("e"), f(1.0))],
        );
        let mut bufs = HashMap::from([
            ("x".into(), Array::f32(&tile_values(Ty::Bf16))),
            ("out".into(), Array::poisoned(Ty::U32, 1)),
        ]);
        run_profiled(&k, &mut bufs, &HashMap::new()).unwrap()
    };
    // The staging's 12 stores take a wavefront each; the load's 4 phases one each, or two.
    let padded = traffic(PITCH).0["tile"];
    assert_eq!(
        (padded.accesses, padded.phases, padded.wavefronts),
        (13, 16, 16),
        "{padded:?}"
    );
    let packed = traffic(COLUMNS).0["tile"];
    assert_eq!(
        (packed.phases, packed.wavefronts, packed.worst),
        (16, 20, 2),
        "{packed:?}"
    );
}

fn fault(k: &Kernel) -> String {
    match run_tile(k, (Ty::U32, 128)) {
        Err(EmuError::Fault { message, .. }) => message,
        other => panic!("expected a fault, got {other:?}"),
    }
}

#[test]
fn misuse_is_reported() {
    let names = x4_names("p", "");
    let x4 = |row: Expr| load_matrix("tile", row, &names, false);
    let row = || lane_offset(Quad::RowsThenColumns, PITCH);
    // A lane sitting it out.
    let k = tile_kernel(vec![if_(lt(lane(), int(31)), vec![x4(row())])], Ty::U32);
    assert!(fault(&k).contains("whole warp"), "{}", fault(&k));
    // A row 8 bytes off its 16-byte boundary.
    let k = tile_kernel(vec![x4(row() + int(4))], Ty::U32);
    assert!(fault(&k).contains("misaligned"), "{}", fault(&k));
    // Rows past the tile.
    let k = tile_kernel(vec![x4(row() + int(ROWS * PITCH))], Ty::U32);
    assert!(fault(&k).contains("out of bounds"), "{}", fault(&k));
    // Rows no thread wrote: the staging dropped.
    let mut k = tile_kernel(vec![x4(row())], Ty::U32);
    k.body.remove(0);
    assert!(fault(&k).contains("never written"), "{}", fault(&k));
    // Rows other threads wrote, read without the barrier.
    let mut k = tile_kernel(vec![x4(row())], Ty::U32);
    k.body.remove(1);
    assert!(fault(&k).contains("__syncthreads"), "{}", fault(&k));
}

#[test]
fn ill_typed_uses_are_refused_before_running() {
    let type_error = |body: Vec<Stmt>| match run_tile(&tile_kernel(body, Ty::U32), (Ty::U32, 128)) {
        Err(EmuError::Type(e)) => e.to_string(),
        other => panic!("expected a type error, got {other:?}"),
    };
    let row = || lane_offset(Quad::RowsThenColumns, PITCH);
    // Three matrices; from a global buffer.
    let three = x4_names("p", "")[..3].to_vec();
    assert!(type_error(vec![load_matrix("tile", row(), &three, false)]).contains("1, 2 or 4"));
    assert!(type_error(vec![load_matrix("x", row(), &x4_names("p", ""), false)]).contains("shared bf16 or f16"));
    // An operand of the wrong size, and f32 locals passed as pairs.
    let pairs = x4_names("p", "");
    let c: [String; 4] = std::array::from_fn(|i| format!("c{i}"));
    let locals: Vec<Stmt> = c.iter().map(|n| let_(n, Ty::F32, f(0.0))).collect();
    let mma = |a: MmaOperand, b: MmaOperand| {
        Stmt::Mma(Box::new(MmaFragments {
            element: MmaElement::Bf16,
            a,
            b,
            c: c.clone(),
        }))
    };
    let loaded = load_matrix("tile", row(), &pairs, false);
    let short = [
        locals.clone(),
        vec![
            loaded.clone(),
            mma(MmaOperand::Pairs(pairs[..2].to_vec()), b_block(&pairs, 0)),
        ],
    ]
    .concat();
    assert!(type_error(short).contains("needs 8"));
    let as_pairs = [
        locals.clone(),
        vec![
            loaded,
            mma(MmaOperand::Pairs(pairs.clone()), MmaOperand::Pairs(c[..2].to_vec())),
        ],
    ]
    .concat();
    assert!(type_error(as_pairs).contains("must be a U32 local"));
}
