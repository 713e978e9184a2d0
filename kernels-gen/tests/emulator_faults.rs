//! The emulator reports what a GPU would silently get wrong.

use kernels_gen::dsl::*;
use kernels_gen::emulator::{run, run_profiled, Array, EmuError, Scalar};
use std::collections::HashMap;

fn kernel(body: Vec<Stmt>, shared: Vec<SharedArray>) -> Kernel {
    Kernel {
        name: "k".into(),
        origin: "test".into(),
        params: vec![buffer("x", Ty::F32, false), buffer("out", Ty::F32, true)],
        shared,
        block_dim: 64,
        grid: int(1),
        body,
    }
}

fn fault(k: &Kernel, out_len: usize) -> String {
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[1.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, out_len)),
    ]);
    match run(k, &mut bufs, &HashMap::new()) {
        Err(EmuError::Fault { message, .. }) => message,
        other => panic!("expected a fault, got {other:?}"),
    }
}

fn scratch() -> Vec<SharedArray> {
    vec![SharedArray {
        name: "s".into(),
        ty: Ty::F32,
        len: 64,
    }]
}

#[test]
fn out_of_bounds_is_reported() {
    let k = kernel(vec![store("out", tid() + int(1), f(1.0))], vec![]);
    assert!(fault(&k, 64).contains("out of bounds"));
}

#[test]
fn reading_unwritten_memory_is_reported() {
    let k = kernel(vec![store("out", tid(), load("s", tid()))], scratch());
    assert!(fault(&k, 64).contains("never written"));
}

#[test]
fn a_missing_barrier_is_reported() {
    let body = vec![
        store("s", tid(), load("x", tid())),
        store("out", tid(), load("s", bin(BinOp::Rem, tid() + int(1), int(64)))),
    ];
    assert!(fault(&kernel(body, scratch()), 64).contains("without a __syncthreads"));
    let fixed = vec![
        store("s", tid(), load("x", tid())),
        Stmt::SyncThreads,
        store("out", tid(), load("s", bin(BinOp::Rem, tid() + int(1), int(64)))),
    ];
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[1.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, 64)),
    ]);
    run(&kernel(fixed, scratch()), &mut bufs, &HashMap::new()).unwrap();
}

/// Reusing a shared buffer before every thread has read it: in lockstep the reads happen to
/// come first, on a GPU a fast warp overwrites what a slow one has yet to read.
#[test]
fn overwriting_what_another_thread_read_without_a_barrier_is_reported() {
    let neighbour = || load("s", bin(BinOp::Rem, tid() + int(1), int(64)));
    let reuse = |barrier: bool| {
        let mut body = vec![
            store("s", tid(), load("x", tid())),
            Stmt::SyncThreads,
            let_("v", Ty::F32, neighbour()),
        ];
        if barrier {
            body.push(Stmt::SyncThreads);
        }
        body.extend([
            store("s", tid(), var("v") * f(2.0)),
            Stmt::SyncThreads,
            store("out", tid(), neighbour()),
        ]);
        body
    };
    assert!(fault(&kernel(reuse(false), scratch()), 64).contains("read by thread"));
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[1.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, 64)),
    ]);
    run(&kernel(reuse(true), scratch()), &mut bufs, &HashMap::new()).unwrap();
    assert_eq!(bufs["out"].to_f32().unwrap(), vec![2.0; 64]);
}

/// A 16-byte load must start on a 16-byte boundary: index a multiple of its width.
#[test]
fn a_misaligned_vector_load_is_reported() {
    let lanes: Vec<String> = (0..4).map(|i| format!("v{i}")).collect();
    let body = |start: i64| {
        vec![
            if_(
                bin(BinOp::Lt, tid(), int(15)),
                vec![
                    load_vec("x", tid() * int(4) + int(start), &lanes),
                    store("out", tid(), var("v3")),
                ],
            ),
            if_(bin(BinOp::Ge, tid(), int(15)), vec![store("out", tid(), f(0.0))]),
        ]
    };
    assert!(fault(&kernel(body(2), vec![]), 64).contains("misaligned"));
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&(0..64).map(|i| i as f32).collect::<Vec<_>>())),
        ("out".into(), Array::poisoned(Ty::F32, 64)),
    ]);
    run(&kernel(body(4), vec![]), &mut bufs, &HashMap::new()).unwrap();
    assert_eq!(bufs["out"].to_f32().unwrap()[..3], [7.0, 11.0, 15.0]);
}

/// `cp.async` of f32 copies 4 elements a thread (16 bytes) and lands at its wait, zeros
/// where it is not valid; a copy off a 16-byte boundary (in the address: a buffer handed
/// from an offset), reading the destination before the wait, and arrays of different types
/// are reported.
#[test]
fn f32_async_copies_land_four_elements_at_their_wait() {
    let copy = |src: Expr, valid: Expr| {
        Stmt::CpAsync(Box::new(AsyncCopy {
            dst: "s".into(),
            dst_index: tid() * int(4),
            src: "x".into(),
            src_index: src,
            valid,
        }))
    };
    let program = |src: Expr, wait: bool| {
        let mut body = vec![
            if_(
                bin(BinOp::Lt, tid(), int(16)),
                vec![copy(src, bin(BinOp::Lt, tid(), int(15))), Stmt::CpAsyncCommit],
            ),
            Stmt::CpAsyncWait(0),
            Stmt::SyncThreads,
        ];
        if !wait {
            body.remove(1);
        }
        body.push(store("out", tid(), load("s", tid())));
        kernel(body, scratch())
    };
    let input: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&input)),
        ("out".into(), Array::poisoned(Ty::F32, 64)),
    ]);
    run(&program(tid() * int(4), true), &mut bufs, &HashMap::new()).unwrap();
    let want: Vec<f32> = (0..64).map(|i| if i < 60 { i as f32 } else { 0.0 }).collect();
    assert_eq!(bufs["out"].to_f32().unwrap(), want);

    assert!(fault(&program(tid() * int(4) + int(2), true), 64).contains("not 16-byte aligned"));
    let mut placed = HashMap::from([
        ("x".into(), Array::f32(&input).placed_at(2)),
        ("out".into(), Array::poisoned(Ty::F32, 64)),
    ]);
    match run(&program(tid() * int(4), true), &mut placed, &HashMap::new()) {
        Err(EmuError::Fault { message, .. }) => assert!(message.contains("not 16-byte aligned"), "{message}"),
        other => panic!("expected a fault, got {other:?}"),
    }
    assert!(fault(&program(tid() * int(4), false), 64).contains("while a cp.async into it is in flight"));

    let mut bf16_dst = program(tid() * int(4), true);
    bf16_dst.shared[0].ty = Ty::Bf16;
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&input)),
        ("out".into(), Array::poisoned(Ty::F32, 64)),
    ]);
    assert!(
        matches!(run(&bf16_dst, &mut bufs, &HashMap::new()), Err(EmuError::Type(m)) if m.to_string().contains("cp.async destination"))
    );
}

/// A vector store writes its values where scalar stores would (a bf16 array's through a
/// shared array, then f32 straight to `out`), counted as one access of its width (8 lanes of
/// 16 bytes one after another: one wavefront a phase); off its width's boundary it is
/// reported, as are widths the device has no store of and stores into read-only buffers.
#[test]
fn a_vector_store_writes_as_scalar_stores_do() {
    let bf16_rows = |vector: bool| -> Vec<Stmt> {
        let values: Vec<Expr> = (0..8).map(|e| load("x", tid()) * f(0.5) + f(e as f32)).collect();
        let stores = match vector {
            true => vec![store_vec("h", tid() * int(8), values)],
            false => values
                .into_iter()
                .enumerate()
                .map(|(e, v)| store("h", tid() * int(8) + int(e as i64), v))
                .collect(),
        };
        [
            stores,
            vec![
                Stmt::SyncThreads,
                store_vec(
                    "out",
                    tid() * int(4),
                    (0..4).map(|e| load("h", tid() * int(8) + int(e))).collect(),
                ),
            ],
        ]
        .concat()
    };
    let halves = vec![SharedArray {
        name: "h".into(),
        ty: Ty::Bf16,
        len: 512,
    }];
    let x: Vec<f32> = (0..64).map(|i| i as f32 - 20.25).collect();
    let outputs = |body: Vec<Stmt>| {
        let mut bufs = HashMap::from([
            ("x".into(), Array::f32(&x)),
            ("out".into(), Array::poisoned(Ty::F32, 256)),
        ]);
        let traffic = run_profiled(&kernel(body, halves.clone()), &mut bufs, &HashMap::new()).unwrap();
        (bufs["out"].to_f32().unwrap(), traffic.0["h"])
    };
    let (vector, traffic) = outputs(bf16_rows(true));
    let (scalar, _) = outputs(bf16_rows(false));
    assert_eq!(vector, scalar);
    let rounded = |v: f32| half::bf16::from_f32(v).to_f32();
    assert_eq!(vector[4 * 3 + 2], rounded(x[3] * 0.5 + 2.0));
    // Two warps' 16-byte stores (4 phases each), then their 2-byte loads, 4 of them.
    assert_eq!((traffic.accesses, traffic.phases, traffic.worst), (2 + 8, 8 + 8, 4));
    let misaligned = vec![store_vec("out", tid() * int(4) + int(2), vec![f(1.0); 4])];
    assert!(fault(&kernel(misaligned, vec![]), 300).contains("vector store of 4 at out[2] is misaligned"));
    let three = kernel(vec![store_vec("out", tid() * int(4), vec![f(1.0); 3])], vec![]);
    let message = kernels_gen::types::check(&three).unwrap_err().to_string();
    assert!(message.contains("a vector store of 3 F32 into `out`"), "{message}");
    let read_only = kernel(vec![store_vec("x", tid() * int(4), vec![f(1.0); 4])], vec![]);
    let message = kernels_gen::types::check(&read_only).unwrap_err().to_string();
    assert!(message.contains("`x` is read-only"), "{message}");
}

#[test]
fn a_barrier_in_divergent_code_is_reported() {
    let k = kernel(
        vec![if_(bin(BinOp::Lt, tid(), int(10)), vec![Stmt::SyncThreads])],
        vec![],
    );
    assert!(fault(&k, 64).contains("divergent"));
}

#[test]
fn racing_stores_are_reported() {
    let k = kernel(vec![store("out", int(0), cast(Ty::F32, tid()))], vec![]);
    assert!(fault(&k, 1).contains("store different values"));
}

/// Signed overflow is undefined in CUDA C++ (and usually an index gone wrong); so is a shift by
/// a negative count or by 32 or more, even on the side of a select that is not taken, and an
/// integer division by zero.
#[test]
fn signed_overflow_and_out_of_range_shifts_are_reported() {
    let k = kernel(
        vec![
            let_("big", Ty::I32, int(1 << 30)),
            store("out", tid(), cast(Ty::F32, var("big") * int(2))),
        ],
        vec![],
    );
    assert!(fault(&k, 64).contains("overflows i32"));
    for count in [tid() - int(1), int(32)] {
        let k = kernel(
            vec![store("out", tid(), cast(Ty::F32, bin(BinOp::Shr, int(8), count)))],
            vec![],
        );
        assert!(fault(&k, 64).contains("a shift by"));
    }
    for op in [BinOp::Div, BinOp::Rem] {
        let k = kernel(
            vec![store("out", tid(), cast(Ty::F32, bin(op, int(8), tid() - int(3))))],
            vec![],
        );
        assert!(fault(&k, 64).contains("integer division by zero"));
    }
}

/// Unsigned arithmetic wraps at 32 bits, as on the device (hashes rely on it).
#[test]
fn unsigned_arithmetic_wraps_at_32_bits() {
    let u = |v: i64| cast(Ty::U32, int(v));
    let product = bin(BinOp::Mul, u(0xFFFF_FFFF), u(3)); // 0xFFFF_FFFD after wrapping
    let top = bin(BinOp::Shr, bin(BinOp::BitXor, product, u(0xF000_0000)), u(24));
    let k = kernel(vec![store("out", tid(), cast(Ty::F32, top))], vec![]);
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[1.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, 64)),
    ]);
    run(&k, &mut bufs, &HashMap::new()).unwrap();
    assert_eq!(bufs["out"].to_f32().unwrap()[0], 0x0F as f32);
}

#[test]
fn a_shuffle_with_inactive_lanes_is_reported() {
    let k = kernel(
        vec![if_(
            bin(BinOp::Lt, lane(), int(16)),
            vec![store("out", tid(), shfl_xor(load("x", tid()), 1))],
        )],
        vec![],
    );
    assert!(fault(&k, 64).contains("lane 16 of the warp inactive"));
}

#[test]
fn type_errors_are_caught_before_running() {
    let k = kernel(vec![store("x", tid(), f(1.0))], vec![]);
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[1.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, 64)),
    ]);
    assert!(matches!(run(&k, &mut bufs, &HashMap::new()), Err(EmuError::Type(_))));
}

/// What NVRTC would reject is rejected before any kernel runs: a name declared twice in one
/// block, or a loop's variable declared again in its body. So is a name an inner block
/// declares again (C++ would shadow the outer one there; the emulator keeps one variable a
/// name, and would read 2 where the device reads 1 below), while blocks side by side may each
/// declare it.
#[test]
fn a_name_declared_twice_in_one_block_or_hiding_a_buffer_is_a_type_error() {
    let twice = vec![let_("v", Ty::F32, f(1.0)), let_("v", Ty::F32, f(2.0))];
    let shadowed = shadowed_v();
    let side_by_side = vec![
        if_(Expr::Bool(true), vec![let_("v", Ty::F32, f(1.0))]),
        if_(Expr::Bool(true), vec![let_("v", Ty::F32, f(2.0))]),
    ];
    // A local named like a buffer hides it in C (at any depth), though the DSL means the array.
    let hides_a_buffer = vec![if_(Expr::Bool(true), vec![let_("x", Ty::I32, int(1))])];
    let loop_hides_a_buffer = vec![for_("x", int(0), int(1), int(1), vec![])];
    for (body, ok) in [
        (twice, false),
        (shadowed, false),
        (side_by_side, true),
        (hides_a_buffer, false),
        (loop_hides_a_buffer, false),
    ] {
        let mut body = body;
        body.push(store("out", tid(), f(0.0)));
        let mut bufs = HashMap::from([
            ("x".into(), Array::f32(&[1.0; 64])),
            ("out".into(), Array::poisoned(Ty::F32, 64)),
        ]);
        let result = run(&kernel(body, vec![]), &mut bufs, &HashMap::new());
        assert_eq!(result.is_ok(), ok, "{result:?}");
    }
    let shadowing = kernel(shadowed_v(), vec![]);
    let message = kernels_gen::types::check(&shadowing).unwrap_err().to_string();
    assert!(message.contains("`v` is declared in an inner block"), "{message}");
}

/// `v` declared, then again in an inner block.
fn shadowed_v() -> Vec<Stmt> {
    vec![
        let_("v", Ty::F32, f(1.0)),
        if_(Expr::Bool(true), vec![let_("v", Ty::F32, f(2.0))]),
        store("out", tid(), var("v")),
    ]
}

#[test]
fn an_mma_with_inactive_lanes_is_reported() {
    let names = |p: &str, n: usize| -> Vec<String> { (0..n).map(|i| format!("{p}{i}")).collect() };
    let (a, b, c) = (names("a", 8), names("b", 4), names("c", 4));
    let mut body: Vec<Stmt> = a.iter().chain(&b).chain(&c).map(|n| let_(n, Ty::F32, f(1.0))).collect();
    body.push(if_(
        bin(BinOp::Lt, lane(), int(31)),
        vec![Stmt::Mma(Box::new(MmaFragments {
            element: MmaElement::Bf16,
            a: MmaOperand::F32(a),
            b: MmaOperand::F32(b),
            c: c.try_into().unwrap(),
        }))],
    ));
    assert!(fault(&kernel(body, vec![]), 64).contains("whole warp"));
}

/// A complete cp.async → wgmma program (one warpgroup, B of 16×8 from shared memory), each
/// step labelled so a test can drop or add one.
fn wgmma_program() -> Vec<(&'static str, Stmt)> {
    let a: [String; 8] = std::array::from_fn(|i| format!("a{i}"));
    let d: Vec<String> = (0..4).map(|i| format!("d{i}")).collect();
    let mut steps = vec![(
        "copy",
        Stmt::CpAsync(Box::new(AsyncCopy {
            dst: "ws".into(),
            dst_index: tid() * int(8),
            src: "w".into(),
            src_index: tid() * int(8),
            valid: Expr::Bool(true),
        })),
    )];
    steps.extend([
        ("commit", Stmt::CpAsyncCommit),
        ("wait", Stmt::CpAsyncWait(0)),
        ("proxy fence", Stmt::FenceProxyAsync),
        ("barrier", Stmt::SyncThreads),
    ]);
    steps.extend(a.iter().map(|n| ("a", let_(n, Ty::F32, f(1.0)))));
    steps.extend(d.iter().map(|n| ("d", let_(n, Ty::F32, f(0.0)))));
    steps.extend([
        ("wgmma fence", Stmt::WgmmaFence),
        (
            "wgmma",
            Stmt::Wgmma(Box::new(WgmmaOp {
                n: 8,
                a: WgmmaA::Registers(a),
                b: SmemMatrix {
                    array: "ws".into(),
                    start: int(0),
                    lbo: 128,
                    sbo: 256,
                    swizzle: Swizzle::None,
                },
                b_major: Major::K,
                d: d.clone(),
            })),
        ),
        ("wgmma commit", Stmt::WgmmaCommit),
        ("wgmma wait", Stmt::WgmmaWait(0)),
    ]);
    steps.extend(
        d.iter()
            .enumerate()
            .map(|(j, n)| ("store", store("out", tid() * int(4) + int(j as i64), var(n)))),
    );
    steps
}

/// Run labelled `steps` as one block of 128 threads over `bufs`: `out` on success, else the
/// fault's message.
fn run_steps(
    params: Vec<Param>,
    shared: Vec<SharedArray>,
    steps: Vec<(&'static str, Stmt)>,
    mut bufs: HashMap<String, Array>,
) -> Result<Vec<f32>, String> {
    let k = Kernel {
        name: "k".into(),
        origin: "test".into(),
        params,
        shared,
        block_dim: 128,
        grid: int(1),
        body: steps.into_iter().map(|(_, s)| s).collect(),
    };
    match run(&k, &mut bufs, &HashMap::new()) {
        Ok(()) => Ok(bufs["out"].to_f32().unwrap()),
        Err(EmuError::Fault { message, .. }) => Err(message),
        Err(e) => panic!("{e}"),
    }
}

fn shared(name: &str, ty: Ty, len: usize) -> SharedArray {
    SharedArray {
        name: name.into(),
        ty,
        len,
    }
}

fn run_wgmma(steps: Vec<(&'static str, Stmt)>) -> Result<Vec<f32>, String> {
    run_steps(
        vec![buffer("w", Ty::Bf16, false), buffer("out", Ty::F32, true)],
        vec![shared("ws", Ty::Bf16, 1024)],
        steps,
        HashMap::from([
            ("w".into(), Array::bf16(&[half::bf16::from_f32(0.5); 1024])),
            ("out".into(), Array::poisoned(Ty::F32, 512)),
        ]),
    )
}

fn without(label: &str) -> Vec<(&'static str, Stmt)> {
    wgmma_program().into_iter().filter(|(l, _)| *l != label).collect()
}

#[test]
fn the_complete_wgmma_program_runs() {
    // Every product is 1 · 0.5 summed over k = 16.
    assert_eq!(run_wgmma(wgmma_program()).unwrap(), vec![8.0; 512]);
}

/// B read MN-major (`imm-trans-b`) unswizzled runs (the uniform operand gives the K-major
/// product; the flash attention's values check the layout itself, the swizzled layout
/// `a_tma_copy_feeds_an_mn_major_swizzled_wgmma`).
#[test]
fn mn_major_operands_run() {
    let steps = wgmma_program()
        .into_iter()
        .map(|(label, s)| match s {
            Stmt::Wgmma(mut w) => {
                w.b_major = Major::MN;
                (label, Stmt::Wgmma(w))
            }
            other => (label, other),
        })
        .collect();
    assert_eq!(run_wgmma(steps).unwrap(), vec![8.0; 512]);
}

#[test]
fn async_copy_and_wgmma_races_are_reported() {
    for (dropped, expected) in [
        ("wait", "while a cp.async into it is in flight"),
        ("proxy fence", "without fence.proxy.async"),
        ("barrier", "without a __syncthreads()"),
        ("wgmma fence", "without a wgmma.fence"),
        ("wgmma wait", "while a wgmma using it is in flight"),
    ] {
        let message = run_wgmma(without(dropped)).unwrap_err();
        assert!(message.contains(expected), "without `{dropped}`: {message}");
    }
}

#[test]
fn overwriting_a_wgmma_operand_in_flight_is_reported() {
    let mut steps = without("wgmma wait");
    let at = steps.iter().position(|(l, _)| *l == "wgmma commit").unwrap() + 1;
    // A barrier does not retire the wgmma: only its wait does.
    steps.insert(at, ("barrier", Stmt::SyncThreads));
    steps.insert(at + 1, ("overwrite", store("ws", tid(), f(0.0))));
    let message = run_wgmma(steps).unwrap_err();
    assert!(
        message.contains("while a tensor-core MMA reading it is in flight"),
        "{message}"
    );
}

fn tc(op: Tcgen05) -> Stmt {
    Stmt::Tcgen05(Box::new(op))
}

/// A complete tcgen05 program: warp 0 allocates 32 TMEM columns, thread 0 multiplies a 128×16
/// A (all 1) by a 16×16 B (all 0.5, in `bs`) and commits, everyone waits, each warp reads
/// its lanes; every step labelled.
fn tcgen05_program() -> Vec<(&'static str, Stmt)> {
    let k_major = |array: &str, height: u32| SmemMatrix {
        array: array.into(),
        start: int(0),
        lbo: height * 16,
        sbo: 128,
        swizzle: Swizzle::None,
    };
    let names: Vec<String> = (0..16).map(|j| format!("v{j}")).collect();
    let mut steps = vec![
        (
            "alloc",
            if_(
                bin(BinOp::Eq, warp(), int(0)),
                vec![tc(Tcgen05::Alloc {
                    columns: 32,
                    slot: "slot".into(),
                })],
            ),
        ),
        (
            "init",
            if_(
                bin(BinOp::Eq, tid(), int(0)),
                vec![Stmt::Mbarrier(Box::new(Mbarrier::Init {
                    barrier: MbarrierRef::whole("bar"),
                    count: 1,
                }))],
            ),
        ),
        (
            "fill a",
            for_(
                "i",
                int(0),
                int(16),
                int(1),
                vec![store("as", tid() * int(16) + var("i"), f(1.0))],
            ),
        ),
        (
            "fill b",
            for_(
                "i",
                int(0),
                int(2),
                int(1),
                vec![store("bs", tid() * int(2) + var("i"), f(0.5))],
            ),
        ),
        ("proxy fence", Stmt::FenceProxyAsync),
        ("barrier", Stmt::SyncThreads),
        ("tmem", let_("tmem", Ty::I32, load("slot", int(0)))),
    ];
    let mma = tc(Tcgen05::Mma(Box::new(TmemMma {
        tmem: var("tmem"),
        a: k_major("as", 128),
        b: k_major("bs", 16),
        b_major: Major::K,
        n: 16,
        accumulate: Expr::Bool(false),
    })));
    let commit = tc(Tcgen05::Commit {
        barrier: MbarrierRef::whole("bar"),
    });
    steps.extend([
        ("mma", if_(bin(BinOp::Eq, tid(), int(0)), vec![mma, commit])),
        (
            "wait",
            Stmt::Mbarrier(Box::new(Mbarrier::Wait {
                barrier: MbarrierRef::whole("bar"),
                parity: int(0),
            })),
        ),
        (
            "load",
            tc(Tcgen05::Load {
                address: var("tmem") + bin(BinOp::Shl, warp() * int(32), int(16)),
                names: names.clone(),
            }),
        ),
        ("wait ld", tc(Tcgen05::WaitLd)),
    ]);
    steps.extend(
        names
            .iter()
            .enumerate()
            .map(|(j, n)| ("store", store("out", tid() * int(16) + int(j as i64), var(n)))),
    );
    steps.extend([
        ("barrier", Stmt::SyncThreads),
        (
            "dealloc",
            if_(
                bin(BinOp::Eq, warp(), int(0)),
                vec![tc(Tcgen05::Dealloc {
                    columns: 32,
                    address: var("tmem"),
                })],
            ),
        ),
    ]);
    steps
}

fn run_tcgen05(steps: Vec<(&'static str, Stmt)>) -> Result<Vec<f32>, String> {
    run_steps(
        vec![buffer("out", Ty::F32, true)],
        vec![
            shared("as", Ty::Bf16, 128 * 16),
            shared("bs", Ty::Bf16, 16 * 16),
            shared("bar", Ty::U32, 2),
            shared("slot", Ty::I32, 1),
        ],
        steps,
        HashMap::from([("out".into(), Array::poisoned(Ty::F32, 128 * 16))]),
    )
}

#[test]
fn the_complete_tcgen05_program_runs() {
    // Every product is 1 · 0.5 summed over k = 16.
    assert_eq!(run_tcgen05(tcgen05_program()).unwrap(), vec![8.0; 128 * 16]);
}

/// `tcgen05.mma` reads B MN-major as `wgmma` does (`b_major`): with A's row i picking
/// k = i % 16 and B[k][n] = 16k + n stored MN-major (core matrices of 8 k by 8 n, the next 8
/// k 128 bytes on, the next 8 n 256; or under the 128-byte swizzle a k's 16 n at the start of
/// a 128-byte row, the next 8 k an atom on), row i of D is B's row i % 16.
#[test]
fn tcgen05_reads_b_mn_major() {
    let mut steps: Vec<(&'static str, Stmt)> = tcgen05_program();
    let at = |label: &str, steps: &[(&str, Stmt)]| steps.iter().position(|(l, _)| *l == label).unwrap();
    let fill_a = at("fill a", &steps);
    steps[fill_a].1 = for_(
        "i",
        int(0),
        int(16),
        int(1),
        vec![store(
            "as",
            tid() / int(8) * int(64)
                + var("i") / int(8) * int(1024)
                + bin(BinOp::Rem, tid(), int(8)) * int(8)
                + bin(BinOp::Rem, var("i"), int(8)),
            select(
                bin(BinOp::Eq, var("i"), bin(BinOp::Rem, tid(), int(16))),
                f(1.0),
                f(0.0),
            ),
        )],
    );
    let fill_b = at("fill b", &steps);
    // Element (n, k)'s place, unswizzled or swizzled (bits 4–6 of its byte address XOR 7–9).
    let place = |swizzle: Swizzle| -> Expr {
        match swizzle {
            Swizzle::None => {
                var("n") / int(8) * int(128)
                    + var("k") / int(8) * int(64)
                    + bin(BinOp::Rem, var("k"), int(8)) * int(8)
                    + bin(BinOp::Rem, var("n"), int(8))
            }
            Swizzle::B128 => {
                let linear = var("k") / int(8) * int(512) + bin(BinOp::Rem, var("k"), int(8)) * int(64) + var("n");
                bin(
                    BinOp::BitXor,
                    linear.clone(),
                    bin(
                        BinOp::Shl,
                        bin(BinOp::BitAnd, bin(BinOp::Shr, linear, int(6)), int(7)),
                        int(3),
                    ),
                )
            }
        }
    };
    let fill = |swizzle: Swizzle| {
        for_(
            "j",
            int(0),
            int(2),
            int(1),
            vec![
                let_("e", Ty::I32, tid() * int(2) + var("j")),
                let_("k", Ty::I32, var("e") / int(16)),
                let_("n", Ty::I32, bin(BinOp::Rem, var("e"), int(16))),
                store("bs", place(swizzle), cast(Ty::F32, var("e"))),
            ],
        )
    };
    let with_b = |steps: &[(&'static str, Stmt)], swizzle: Swizzle| -> Vec<(&'static str, Stmt)> {
        let mut steps = steps.to_vec();
        steps[fill_b].1 = fill(swizzle);
        let mma = at("mma", &steps);
        let Stmt::If {
            cond,
            mut then,
            otherwise,
        } = steps[mma].1.clone()
        else {
            unreachable!()
        };
        let Stmt::Tcgen05(op) = &then[0] else { unreachable!() };
        let Tcgen05::Mma(m) = &**op else { unreachable!() };
        let mut m = (**m).clone();
        m.b = SmemMatrix {
            array: "bs".into(),
            start: int(0),
            lbo: if swizzle == Swizzle::None { 128 } else { 2048 },
            sbo: if swizzle == Swizzle::None { 256 } else { 1024 },
            swizzle,
        };
        m.b_major = Major::MN;
        then[0] = tc(Tcgen05::Mma(Box::new(m)));
        steps[mma].1 = Stmt::If { cond, then, otherwise };
        steps
    };
    let want: Vec<f32> = (0..128 * 16).map(|e| ((e / 16) % 16 * 16 + e % 16) as f32).collect();
    assert_eq!(run_tcgen05(with_b(&steps, Swizzle::None)).unwrap(), want);
    // Swizzled: two atoms of 8 k, the array 1024-byte aligned.
    let swizzled = run_steps(
        vec![buffer("out", Ty::F32, true)],
        vec![
            shared("as", Ty::Bf16, 128 * 16),
            shared("bs", Ty::Bf16, 1024),
            shared("bar", Ty::U32, 2),
            shared("slot", Ty::I32, 1),
        ],
        with_b(&steps, Swizzle::B128),
        HashMap::from([("out".into(), Array::poisoned(Ty::F32, 128 * 16))]),
    );
    assert_eq!(swizzled.unwrap(), want);
}

#[test]
fn tcgen05_races_and_leaks_are_reported() {
    let without = |label: &str| -> Vec<(&'static str, Stmt)> {
        tcgen05_program().into_iter().filter(|(l, _)| *l != label).collect()
    };
    for (dropped, expected) in [
        ("wait", "before waiting on the `bar[0]` phase"),
        ("wait ld", "before tcgen05.wait::ld"),
        ("dealloc", "still allocated when the block exits"),
        ("proxy fence", "without fence.proxy.async"),
        ("init", "before mbarrier.init"),
    ] {
        let message = run_tcgen05(without(dropped)).unwrap_err();
        assert!(message.contains(expected), "without `{dropped}`: {message}");
    }
    // The MMA issued by every thread, a second wait on a phase nobody completes, and warps
    // reading each other's lanes.
    let mut everyone = tcgen05_program();
    let at = everyone.iter().position(|(l, _)| *l == "mma").unwrap();
    let Stmt::If { then, .. } = everyone[at].1.clone() else {
        unreachable!()
    };
    everyone[at].1 = then[0].clone();
    assert!(run_tcgen05(everyone).unwrap_err().contains("one thread issues it"));
    let mut twice = tcgen05_program();
    let at = twice.iter().position(|(l, _)| *l == "wait").unwrap();
    twice.insert(
        at,
        (
            "wait",
            Stmt::Mbarrier(Box::new(Mbarrier::Wait {
                barrier: MbarrierRef::whole("bar"),
                parity: int(1),
            })),
        ),
    );
    assert!(run_tcgen05(twice).unwrap_err().contains("never completes"));
    // Its operands are read some time after the MMA is issued: overwriting them before the
    // wait for its commit races it.
    let mut early = tcgen05_program();
    let at = early.iter().position(|(l, _)| *l == "wait").unwrap();
    early.insert(at, ("overwrite", store("bs", tid(), f(0.0))));
    let message = run_tcgen05(early).unwrap_err();
    assert!(
        message.contains("which completes the tcgen05.mma reading it"),
        "{message}"
    );
    let mut crossed = tcgen05_program();
    let at = crossed.iter().position(|(l, _)| *l == "load").unwrap();
    crossed[at].1 = tc(Tcgen05::Load {
        address: var("tmem"),
        names: (0..16).map(|j| format!("v{j}")).collect(),
    });
    assert!(run_tcgen05(crossed).unwrap_err().contains("it may read only"));
}

/// A prefetch changes nothing but must point inside its buffer; one from shared memory, which
/// `prefetch.global` cannot take, does not type-check.
#[test]
fn prefetches_stay_inside_global_buffers() {
    let inside = kernel(
        vec![prefetch_l2("x", tid()), store("out", tid(), load("x", tid()))],
        vec![],
    );
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[2.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, 64)),
    ]);
    run(&inside, &mut bufs, &HashMap::new()).unwrap();
    assert_eq!(bufs["out"].to_f32().unwrap(), vec![2.0; 64]);
    let past = kernel(vec![prefetch_l2("x", tid() + int(1))], vec![]);
    assert!(fault(&past, 64).contains("prefetch of x[64] out of bounds"));
    let shared = kernel(vec![prefetch_l2("s", tid())], scratch());
    let err = kernels_gen::types::check(&shared).unwrap_err().to_string();
    assert!(err.contains("not a global buffer"), "{err}");
}

/// A kernel made to prefetch the next matmul's weights computes what it did, prefetching the
/// lines of the first `prefetch_bytes` across its grid; asked for lines past the buffer, it
/// faults.
#[test]
fn prefetching_the_next_weights_changes_nothing_and_stays_in_bounds() {
    use kernels_gen::templates::{glu, weight_prefetch};
    let plain = glu::glu("glu", "test", ir::GluAct::Silu);
    let prefetching = weight_prefetch::prefetching_next_weights(plain.clone());
    let (tokens, n) = (3i64, 40i64);
    let x: Vec<f32> = (0..tokens * 2 * n).map(|i| (i % 11) as f32 / 7.0 - 0.5).collect();
    let scalars = |prefetch_bytes: i64| {
        HashMap::from([
            ("tokens".to_string(), Scalar::Int(tokens)),
            ("n".to_string(), Scalar::Int(n)),
            ("x_stride".to_string(), Scalar::Int(2 * n)),
            ("prefetch_bytes".to_string(), Scalar::Int(prefetch_bytes)),
        ])
    };
    let run_with = |kernel: &Kernel, prefetch_bytes: i64| {
        let mut bufs = HashMap::from([
            ("x".into(), Array::f32(&x)),
            ("out".into(), Array::poisoned(Ty::F32, (tokens * n) as usize)),
            ("next_w".into(), Array::u8(&[7u8; 1000])),
        ]);
        run(kernel, &mut bufs, &scalars(prefetch_bytes)).map(|_| bufs.remove("out").unwrap())
    };
    let want = run_with(&plain, 0).unwrap().to_f32().unwrap();
    for bytes in [0, 1, 1000] {
        assert_eq!(
            run_with(&prefetching, bytes).unwrap().to_f32().unwrap(),
            want,
            "{bytes}"
        );
    }
    // The line at 1024 lies past the buffer (lines start every 128 bytes below the count).
    let err = run_with(&prefetching, 1025).unwrap_err().to_string();
    assert!(err.contains("prefetch of next_w[1024] out of bounds"), "{err}");
}

fn mbarrier(op: Mbarrier) -> Stmt {
    Stmt::Mbarrier(Box::new(op))
}

fn bar() -> MbarrierRef {
    MbarrierRef::whole("bar")
}

/// The 64×64 bf16 matrix the TMA programs copy: small integers over 4, exact in bf16.
fn tma_source() -> Vec<f32> {
    (0..64 * 64)
        .map(|i| ((i / 64 * 7 + i % 64 * 3) % 11) as f32 / 4.0 - 1.25)
        .collect()
}

/// The 128-byte-swizzled operand of 64-element rows at `start` of `xs`.
fn swizzled(start: i64) -> SmemMatrix {
    SmemMatrix {
        array: "xs".into(),
        start: int(start),
        lbo: 16,
        sbo: 1024,
        swizzle: Swizzle::B128,
    }
}

/// A complete TMA program for one warpgroup: thread 0 initialises an mbarrier, announces
/// 8 KiB on it and copies the 64×64 source into `xs` under the 128-byte swizzle; everyone
/// waits for the phase; a wgmma multiplies the first 16 columns of all 64 rows (A, from
/// shared memory) by those of the first 8 rows (B) and each thread stores its accumulators at
/// their (row, column) of the 64×8 `out`. Every step labelled.
fn tma_program() -> Vec<(&'static str, Stmt)> {
    let d: Vec<String> = (0..4).map(|j| format!("d{j}")).collect();
    let first = |body: Vec<Stmt>| if_(eq(tid(), int(0)), body);
    let copy = |bytes: u32| {
        vec![
            mbarrier(Mbarrier::ArriveExpectTx { barrier: bar(), bytes }),
            Stmt::TmaLoad(Box::new(TmaLoad {
                map: "x_map".into(),
                dst: "xs".into(),
                dst_index: int(0),
                row: int(0),
                col: int(0),
                barrier: bar(),
            })),
        ]
    };
    let mut steps = vec![
        (
            "init",
            first(vec![mbarrier(Mbarrier::Init {
                barrier: bar(),
                count: 1,
            })]),
        ),
        ("barrier", Stmt::SyncThreads),
        ("copy", first(copy(8192))),
        (
            "wait",
            mbarrier(Mbarrier::Wait {
                barrier: bar(),
                parity: int(0),
            }),
        ),
    ];
    steps.extend(d.iter().map(|n| ("d", let_(n, Ty::F32, f(0.0)))));
    steps.extend([
        ("wgmma fence", Stmt::WgmmaFence),
        (
            "wgmma",
            Stmt::Wgmma(Box::new(WgmmaOp {
                n: 8,
                a: WgmmaA::Shared(swizzled(0)),
                b: swizzled(0),
                b_major: Major::K,
                d: d.clone(),
            })),
        ),
        ("wgmma commit", Stmt::WgmmaCommit),
        ("wgmma wait", Stmt::WgmmaWait(0)),
    ]);
    for (j, name) in d.iter().enumerate() {
        let row = warp() * int(16) + lane() / int(4) + int(if j >= 2 { 8 } else { 0 });
        let col = rem(lane(), int(4)) * int(2) + int(j as i64 % 2);
        steps.push(("store", store("out", row * int(8) + col, var(name))));
    }
    steps
}

/// The tensor map of `tma_program`: the whole 64×64 source, rows `stride` apart.
fn tma_map(cols: i64, stride: i64, box_cols: u32) -> Param {
    Param::TensorMap(Box::new(TensorMap {
        name: "x_map".into(),
        buffer: "x".into(),
        rows: int(64),
        cols: int(cols),
        stride: int(stride),
        box_rows: 64,
        box_cols,
        swizzle: Swizzle::B128,
    }))
}

/// Run a TMA program over `source` with map `map`: `out`, or the error's message.
fn run_tma_with(steps: Vec<(&'static str, Stmt)>, map: Param, source: &[f32]) -> Result<Vec<f32>, String> {
    run_tma_over(steps, map, source, (Ty::Bf16, Ty::Bf16))
}

/// [`run_tma_with`] with the mapped buffer `x` of `buffer` elements (bf16, f16 or f32) and the
/// shared `xs` it lands in of `tile` elements.
fn run_tma_over(
    steps: Vec<(&'static str, Stmt)>,
    map: Param,
    source: &[f32],
    (buffer_ty, tile): (Ty, Ty),
) -> Result<Vec<f32>, String> {
    let k = Kernel {
        name: "k".into(),
        origin: "test".into(),
        params: vec![buffer("x", buffer_ty, false), buffer("out", Ty::F32, true), map],
        shared: vec![shared("xs", tile, 64 * 64), shared("bar", Ty::U32, 2)],
        block_dim: 128,
        grid: int(1),
        body: steps.into_iter().map(|(_, s)| s).collect(),
    };
    let x = match buffer_ty {
        Ty::F16 => Array::f16(&source.iter().map(|&v| half::f16::from_f32(v)).collect::<Vec<_>>()),
        Ty::Bf16 => Array::bf16(&source.iter().map(|&v| half::bf16::from_f32(v)).collect::<Vec<_>>()),
        _ => Array::f32(source),
    };
    let mut bufs = HashMap::from([("x".into(), x), ("out".into(), Array::poisoned(Ty::F32, 64 * 8))]);
    match run(&k, &mut bufs, &HashMap::new()) {
        Ok(()) => Ok(bufs["out"].to_f32().unwrap()),
        Err(EmuError::Fault { message, .. } | EmuError::Launch { message, .. }) => Err(message),
        Err(e) => Err(e.to_string()),
    }
}

fn run_tma(steps: Vec<(&'static str, Stmt)>) -> Result<Vec<f32>, String> {
    run_tma_with(steps, tma_map(64, 64, 64), &tma_source())
}

/// `out[r·8 + c] = Σ_k<16 x[r][k]·x[c][k]`: what `tma_program` computes.
fn tma_product(x: &[f32]) -> Vec<f32> {
    (0..64 * 8)
        .map(|i| (0..16).map(|k| x[i / 8 * 64 + k] * x[i % 8 * 64 + k]).sum())
        .collect()
}

/// `tma_program` with the step labelled `label` replaced by `with` (removed when `None`).
fn tma_changed(label: &str, with: Option<Stmt>) -> Vec<(&'static str, Stmt)> {
    let mut steps = tma_program();
    let at = steps.iter().position(|(l, _)| *l == label).unwrap();
    match with {
        Some(s) => steps[at].1 = s,
        None => {
            steps.remove(at);
        }
    }
    steps
}

#[test]
fn a_tma_copy_feeds_a_swizzled_wgmma() {
    assert_eq!(run_tma(tma_program()).unwrap(), tma_product(&tma_source()));
    // Read as if unswizzled, the same bytes are other elements: the layouts must agree.
    let mut plain = tma_program();
    let at = plain.iter().position(|(l, _)| *l == "wgmma").unwrap();
    let Stmt::Wgmma(op) = &mut plain[at].1 else {
        unreachable!()
    };
    op.b.swizzle = Swizzle::None;
    op.b.lbo = 128;
    assert_ne!(run_tma(plain).unwrap(), tma_product(&tma_source()));
    // Zeros past the tensor's columns: a map of 56 columns leaves the last 8 of each row 0.
    let mut clipped = tma_source();
    for (i, v) in clipped.iter_mut().enumerate() {
        if i % 64 >= 56 {
            *v = 0.0;
        }
    }
    let mut wide = tma_changed("wgmma", None);
    let at = wide.iter().position(|(l, _)| *l == "wgmma fence").unwrap() + 1;
    let slice = |start| {
        Stmt::Wgmma(Box::new(WgmmaOp {
            n: 8,
            a: WgmmaA::Shared(swizzled(start)),
            b: swizzled(start),
            b_major: Major::K,
            d: (0..4).map(|j| format!("d{j}")).collect(),
        }))
    };
    // The last k slice (columns 48..64) of the clipped copy.
    wide.insert(at, ("wgmma", slice(48)));
    let got = run_tma_with(wide, tma_map(56, 64, 64), &tma_source()).unwrap();
    let want: Vec<f32> = (0..64 * 8)
        .map(|i| {
            (48..64)
                .map(|k| clipped[i / 8 * 64 + k] * clipped[i % 8 * 64 + k])
                .sum()
        })
        .collect();
    assert_eq!(got, want);
}

/// A 64×128 source copied as two boxes of 64 columns, the second 8 KiB on, read as an
/// MN-major swizzled B (`Major::MN` under `Swizzle::B128`: a row's 64 columns of one k, `lbo`
/// on to the next 64 columns, `sbo` to the next 8 k): two k slices of 16 (A the source's rows,
/// K-major) make `out[r][c] = Σ_k<32 x[r][k]·x[k][c]` over all 128 columns. The same bytes
/// read K-major or unswizzled are other elements, and a start inside an atom is reported.
#[test]
fn a_tma_copy_feeds_an_mn_major_swizzled_wgmma() {
    let source: Vec<f32> = (0..64 * 128)
        .map(|i| ((i / 128 * 5 + i % 128 * 3) % 13) as f32 / 4.0 - 1.5)
        .collect();
    let want: Vec<f32> = (0..64 * 128)
        .map(|i| {
            (0..32)
                .map(|k| source[i / 128 * 128 + k] * source[k * 128 + i % 128])
                .sum()
        })
        .collect();
    let bf16_source: Vec<half::bf16> = source.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let d: Vec<String> = (0..64).map(|j| format!("d{j}")).collect();
    let run_with = |b: &dyn Fn(i64) -> SmemMatrix, b_major: Major, second: i64| -> Result<Vec<f32>, String> {
        let first_thread = |body: Vec<Stmt>| if_(eq(tid(), int(0)), body);
        let copy = |col: i64, dst: i64| {
            Stmt::TmaLoad(Box::new(TmaLoad {
                map: "x_map".into(),
                dst: "xs".into(),
                dst_index: int(dst),
                row: int(0),
                col: int(col),
                barrier: bar(),
            }))
        };
        let wgmma = |a: i64, b: SmemMatrix| {
            Stmt::Wgmma(Box::new(WgmmaOp {
                n: 128,
                a: WgmmaA::Shared(swizzled(a)),
                b,
                b_major,
                d: d.clone(),
            }))
        };
        let mut body = vec![
            first_thread(vec![mbarrier(Mbarrier::Init {
                barrier: bar(),
                count: 1,
            })]),
            Stmt::SyncThreads,
            first_thread(vec![
                mbarrier(Mbarrier::ArriveExpectTx {
                    barrier: bar(),
                    bytes: 16384,
                }),
                copy(0, 0),
                copy(64, 4096),
            ]),
            mbarrier(Mbarrier::Wait {
                barrier: bar(),
                parity: int(0),
            }),
        ];
        body.extend(d.iter().map(|n| let_(n, Ty::F32, f(0.0))));
        body.extend([
            Stmt::WgmmaFence,
            wgmma(0, b(0)),
            wgmma(16, b(second)),
            Stmt::WgmmaCommit,
            Stmt::WgmmaWait(0),
        ]);
        for (j, name) in d.iter().enumerate() {
            let row = warp() * int(16) + lane() / int(4) + int(if j % 4 >= 2 { 8 } else { 0 });
            let col = int(8 * (j as i64 / 4)) + rem(lane(), int(4)) * int(2) + int(j as i64 % 2);
            body.push(store("out", row * int(128) + col, var(name)));
        }
        let k = Kernel {
            name: "k".into(),
            origin: "test".into(),
            params: vec![
                buffer("x", Ty::Bf16, false),
                buffer("out", Ty::F32, true),
                Param::TensorMap(Box::new(TensorMap {
                    name: "x_map".into(),
                    buffer: "x".into(),
                    rows: int(64),
                    cols: int(128),
                    stride: int(128),
                    box_rows: 64,
                    box_cols: 64,
                    swizzle: Swizzle::B128,
                })),
            ],
            shared: vec![shared("xs", Ty::Bf16, 64 * 128), shared("bar", Ty::U32, 2)],
            block_dim: 128,
            grid: int(1),
            body,
        };
        let mut bufs = HashMap::from([
            ("x".into(), Array::bf16(&bf16_source)),
            ("out".into(), Array::poisoned(Ty::F32, 64 * 128)),
        ]);
        match run(&k, &mut bufs, &HashMap::new()) {
            Ok(()) => Ok(bufs["out"].to_f32().unwrap()),
            Err(EmuError::Fault { message, .. }) => Err(message),
            Err(e) => Err(e.to_string()),
        }
    };
    let mn_major = |swizzle: Swizzle, lbo: u32, sbo: u32| {
        move |start: i64| SmemMatrix {
            array: "xs".into(),
            start: int(start),
            lbo,
            sbo,
            swizzle,
        }
    };
    // k rows 16..32 are the atoms 2 and 3 of each 64-column half: 1024 elements on.
    assert_eq!(
        run_with(&mn_major(Swizzle::B128, 8192, 1024), Major::MN, 1024).unwrap(),
        want
    );
    assert_ne!(
        run_with(&mn_major(Swizzle::None, 128, 256), Major::MN, 1024).unwrap(),
        want
    );
    // K-major, rows 512 bytes apart to stay inside the array.
    assert_ne!(run_with(&mn_major(Swizzle::B128, 16, 512), Major::K, 16).unwrap(), want);
    let inside = run_with(&mn_major(Swizzle::B128, 8192, 1024), Major::MN, 1024 + 64).unwrap_err();
    assert!(inside.contains("starts at a 1024-byte atom"), "{inside}");
}

#[test]
fn tma_and_mbarrier_misuse_is_reported() {
    let copy = |bytes: u32, dst_index: i64| {
        if_(
            eq(tid(), int(0)),
            vec![
                mbarrier(Mbarrier::ArriveExpectTx { barrier: bar(), bytes }),
                Stmt::TmaLoad(Box::new(TmaLoad {
                    map: "x_map".into(),
                    dst: "xs".into(),
                    dst_index: int(dst_index),
                    row: int(0),
                    col: int(0),
                    barrier: bar(),
                })),
            ],
        )
    };
    let Stmt::If { then: every_thread, .. } = copy(8192, 0) else {
        unreachable!()
    };
    let wrong_parity = mbarrier(Mbarrier::Wait {
        barrier: bar(),
        parity: int(1),
    });
    let init = mbarrier(Mbarrier::Init {
        barrier: bar(),
        count: 1,
    });
    for (case, steps, expected) in [
        (
            "no wait",
            tma_changed("wait", None),
            "before waiting for phase 0 of mbarrier bar[0]",
        ),
        ("no init", tma_changed("init", None), "before mbarrier.init"),
        (
            "bytes short",
            tma_changed("copy", Some(copy(4096, 0))),
            "4096 transaction bytes more than its phase announced",
        ),
        (
            "bytes over",
            tma_changed("copy", Some(copy(16384, 0))),
            "never completes (1 of 1 arrivals, 8192 transaction bytes outstanding)",
        ),
        (
            "wrong parity",
            tma_changed("wait", Some(wrong_parity)),
            "never completes",
        ),
        (
            "misaligned",
            tma_changed("copy", Some(copy(8192, 64))),
            "must be 1024-byte aligned",
        ),
        (
            "every thread initialises",
            tma_changed("init", Some(init)),
            "one thread issues it",
        ),
    ] {
        let message = run_tma(steps).unwrap_err();
        assert!(message.contains(expected), "{case}: {message}");
    }
    // Every thread announcing and copying: the second arrival finds the phase full.
    let mut all = tma_program();
    let at = all.iter().position(|(l, _)| *l == "copy").unwrap();
    all.splice(at..at + 1, every_thread.into_iter().map(|s| ("copy", s)));
    assert!(run_tma(all).unwrap_err().contains("whose phase has all its 1 arrivals"));
    // Writing the destination before the wait races the copy.
    let mut early = tma_program();
    let at = early.iter().position(|(l, _)| *l == "wait").unwrap();
    early.insert(at, ("overwrite", store("xs", tid(), f(0.0))));
    let message = run_tma(early).unwrap_err();
    assert!(
        message.contains("overwrites xs[") && message.contains("before waiting"),
        "{message}"
    );
    // Refilling while the wgmma reading the buffer is in flight.
    let mut refill = tma_program();
    let at = refill.iter().position(|(l, _)| *l == "wgmma commit").unwrap() + 1;
    refill.insert(at, ("refill", copy(8192, 0)));
    let message = run_tma(refill).unwrap_err();
    assert!(
        message.contains("while a tensor-core MMA reading it is in flight"),
        "{message}"
    );
    // A k slice of a swizzled operand must stay inside its 128-byte row.
    let mut crossing = tma_program();
    let at = crossing.iter().position(|(l, _)| *l == "wgmma").unwrap();
    let Stmt::Wgmma(op) = &mut crossing[at].1 else {
        unreachable!()
    };
    op.b.start = int(56);
    assert!(run_tma(crossing)
        .unwrap_err()
        .contains("crosses its 128-byte swizzled row"));
}

#[test]
fn tensor_maps_the_driver_would_refuse_are_reported() {
    let source = tma_source();
    let message = run_tma_with(tma_program(), tma_map(60, 60, 64), &source).unwrap_err();
    assert!(message.contains("120 bytes apart, not a multiple of 16"), "{message}");
    let message = run_tma_with(tma_program(), tma_map(64, 64, 64), &source[..4000]).unwrap_err();
    assert!(message.contains("over `x` of 4000 elements"), "{message}");
    let message = run_tma_with(tma_program(), tma_map(64, 64, 32), &source).unwrap_err();
    assert!(
        message.contains("a 128-byte swizzle takes boxes 64 elements wide, not 32"),
        "{message}"
    );
}

/// A map over half elements copies them as they are into a half tile, which the `wgmma` reads
/// as halves (values exact in f16 that bf16 would round: the product is the halves'); a map
/// over f32, or a half map landing in a bf16 tile, is refused before running.
#[test]
fn tma_maps_copy_halves_and_their_misuse_is_refused() {
    let halves: Vec<f32> = tma_source().iter().map(|v| v + 1.0 / 512.0).collect();
    let as_bf16: Vec<f32> = halves.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    assert_ne!(tma_product(&as_bf16), tma_product(&halves));
    let (map, program) = (|| tma_map(64, 64, 64), tma_program);
    let got = run_tma_over(program(), map(), &halves, (Ty::F16, Ty::F16)).unwrap();
    let want = tma_product(&halves);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{g} vs {w}");
    }
    let message = run_tma_over(program(), map(), &halves, (Ty::F32, Ty::F32)).unwrap_err();
    assert!(message.contains("not a global bf16 or f16 array"), "{message}");
    let message = run_tma_over(program(), map(), &halves, (Ty::F16, Ty::Bf16)).unwrap_err();
    assert!(
        message.contains("must be a shared f16 array, as its map's buffer"),
        "{message}"
    );
}

#[test]
fn shared_memory_past_what_a_block_may_have_is_refused() {
    let k = kernel(vec![], vec![shared("big", Ty::F32, SHARED_LIMIT / 4 + 1)]);
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[1.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, 1)),
    ]);
    match run(&k, &mut bufs, &HashMap::new()) {
        Err(EmuError::Launch { message, .. }) => assert!(message.contains("bytes of shared memory"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert!(k.shared_layout().dynamic);
}

/// Shared arrays past the static 48 KiB go into one dynamic allocation, each 16-byte aligned
/// (the device's own alignment of it, so nothing is added); in a kernel with TMA or swizzled
/// operands the allocation has 1 KiB more to reach a 1 KiB-aligned base, and the arrays TMA
/// writes (or swizzled operands read) start 1 KiB aligned, the others 16 bytes. Small kernels
/// keep static arrays.
#[test]
fn dynamic_shared_memory_aligns_as_its_kernel_needs() {
    let arrays = || vec![shared("a", Ty::F32, 12_289), shared("b", Ty::Bf16, 3)];
    let plain = kernel(vec![], arrays());
    let layout = plain.shared_layout();
    assert!(layout.dynamic);
    assert_eq!((layout.alignment, layout.offsets.clone()), (16, vec![0, 49_168]));
    assert_eq!(layout.bytes, 49_168 + 16);
    let mut tma = kernel(vec![], arrays());
    tma.params.push(tma_map(64, 64, 64));
    let layout = tma.shared_layout();
    assert_eq!((layout.alignment, layout.offsets.clone()), (1024, vec![0, 49_168]));
    assert_eq!(layout.bytes, 49_184 + 1024);
    tma.body.push(Stmt::TmaLoad(Box::new(TmaLoad {
        map: "x_map".into(),
        dst: "b".into(),
        dst_index: int(0),
        row: int(0),
        col: int(0),
        barrier: bar(),
    })));
    let layout = tma.shared_layout();
    assert_eq!(
        (layout.alignment, layout.offsets.clone()),
        (1024, vec![0, 49_152 + 1024])
    );
    assert_eq!(layout.bytes, 49_152 + 1024 + 16 + 1024);
    let small = kernel(vec![], vec![shared("a", Ty::F32, 64)]).shared_layout();
    assert!(!small.dynamic);
    assert_eq!(small.bytes, 256);
}

/// Warp-specialised roles each run their body: each role's threads store every iteration of
/// their loop, the second role declaring before its loop what the loop and what follows use.
/// Roles take whole warps and a thread one role: a warp split between roles, or a thread in
/// two, is refused.
#[test]
fn roles_take_whole_warps_one_role_a_thread() {
    let roles = |first: Expr, second: Expr| {
        Stmt::Roles(Box::new(Roles {
            roles: vec![
                Role {
                    cond: first,
                    body: vec![for_(
                        "i",
                        int(0),
                        int(2),
                        int(1),
                        vec![store("out", tid() + int(64) * var("i"), f(1.0))],
                    )],
                },
                Role {
                    cond: second,
                    body: vec![
                        let_("kept", Ty::F32, f(2.0)),
                        for_(
                            "i",
                            int(0),
                            int(2),
                            int(1),
                            vec![store("out", tid() + int(64) * var("i"), var("kept"))],
                        ),
                        assign("kept", f(3.0)),
                    ],
                },
            ],
        }))
    };
    let whole_warps = kernel(vec![roles(lt(tid(), int(32)), bin(BinOp::Ge, tid(), int(32)))], vec![]);
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[1.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, 128)),
    ]);
    run(&whole_warps, &mut bufs, &HashMap::new()).unwrap();
    let out = bufs["out"].to_f32().unwrap();
    let want: Vec<f32> = (0..128).map(|i| if i % 64 < 32 { 1.0 } else { 2.0 }).collect();
    assert_eq!(out, want);
    let split = kernel(vec![roles(lt(tid(), int(16)), bin(BinOp::Ge, tid(), int(16)))], vec![]);
    assert!(fault(&split, 128).contains("roles take whole warps"));
    let both = kernel(vec![roles(lt(tid(), int(64)), bin(BinOp::Ge, tid(), int(32)))], vec![]);
    assert!(fault(&both, 128).contains("is in roles 0 and 1 at once"));
}

/// Roles run as coroutines, so their loops need not match: the first warp waits each round
/// for a phase the second completes only after a loop of its own, and goes on once it has
/// (lockstep would report the first wait as never completing). Roles that each wait for the
/// other's arrival are reported with the wait that never completes.
#[test]
fn roles_meet_at_mbarriers_however_their_loops_nest() {
    let (ready, answer) = (MbarrierRef::whole("ready"), MbarrierRef::whole("answer"));
    let on_first = |body: Vec<Stmt>| if_(eq(lane(), int(0)), body);
    let program = |waits_for_answer: bool| {
        let waiter = [
            vec![mbarrier(Mbarrier::Wait {
                barrier: ready.clone(),
                parity: rem(var("round"), int(2)),
            })],
            vec![store(
                "out",
                tid() + int(64) * var("round"),
                cast(Ty::F32, var("round")),
            )],
            vec![on_first(vec![mbarrier(Mbarrier::Arrive {
                barrier: answer.clone(),
            })])],
        ]
        .concat();
        let mut worker = vec![for_(
            "i",
            int(0),
            int(3),
            int(1),
            vec![store("out", tid() + int(64) * var("round"), cast(Ty::F32, var("i")))],
        )];
        if waits_for_answer {
            worker.push(mbarrier(Mbarrier::Wait {
                barrier: answer.clone(),
                parity: rem(var("round"), int(2)),
            }));
        }
        worker.push(on_first(vec![mbarrier(Mbarrier::Arrive { barrier: ready.clone() })]));
        let rounds = |body| vec![for_("round", int(0), int(2), int(1), body)];
        kernel(
            vec![
                if_(
                    eq(tid(), int(0)),
                    vec![
                        mbarrier(Mbarrier::Init {
                            barrier: ready.clone(),
                            count: 1,
                        }),
                        mbarrier(Mbarrier::Init {
                            barrier: answer.clone(),
                            count: 1,
                        }),
                    ],
                ),
                Stmt::SyncThreads,
                Stmt::Roles(Box::new(Roles {
                    roles: vec![
                        Role {
                            cond: lt(warp(), int(1)),
                            body: rounds(waiter),
                        },
                        Role {
                            cond: eq(warp(), int(1)),
                            body: rounds(worker),
                        },
                    ],
                })),
            ],
            vec![shared("ready", Ty::U32, 2), shared("answer", Ty::U32, 2)],
        )
    };
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[1.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, 128)),
    ]);
    run(&program(false), &mut bufs, &HashMap::new()).unwrap();
    let want: Vec<f32> = (0..128)
        .map(|i| if i % 64 < 32 { (i / 64) as f32 } else { 2.0 })
        .collect();
    assert_eq!(bufs["out"].to_f32().unwrap(), want);
    let message = fault(&program(true), 128);
    assert!(
        message.contains("waits on phase parity 0 of mbarrier ready[0], which never completes"),
        "{message}"
    );
}

/// How the producer warp of [`a_producer_warp_hands_over_shared_memory_through_mbarriers`]
/// fills its buffer and publishes it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Handover {
    /// Each lane stores, then arrives.
    Stores,
    /// Each lane copies (`cp.async`), waits for its copy, then arrives.
    Copies,
    /// Each lane stores, arrives on another barrier, then on the consumers' with no store
    /// between (an arrival releases every write before it, not only those since the last).
    ArrivesTwice,
    /// Each lane arrives, then stores.
    ArrivesFirst,
    /// Each lane copies and arrives without waiting for its copy.
    CopiesInFlight,
    /// Each lane stores; lane 0 alone arrives (a barrier of one arrival).
    OneLaneArrives,
    /// Each lane stores and arrives; the consumers read without waiting.
    ConsumersDoNotWait,
}

/// A producer warp hands what it writes to a consumer warp through an mbarrier, with no
/// `__syncthreads()` between: each round it stores or copies into a fresh part of a shared
/// buffer and arrives; the consumers wait on the phase and each reads what another lane
/// wrote. An arrival releases its thread's writes (stores, and copies once landed; every
/// write before it, even one an arrival on another barrier released), a wait acquires them;
/// so arriving before writing, before a copy has landed, or from one lane for the warp, and
/// reading without the wait, are each reported.
#[test]
fn a_producer_warp_hands_over_shared_memory_through_mbarriers() {
    let full = MbarrierRef::whole("full");
    let program = |handover: Handover| {
        // A lane's 16 bytes: 8 bf16 elements.
        let at = var("round") * int(256) + lane() * int(8);
        let write = match handover {
            Handover::Copies | Handover::CopiesInFlight => vec![
                Stmt::CpAsync(Box::new(AsyncCopy {
                    dst: "buf".into(),
                    dst_index: at.clone(),
                    src: "x".into(),
                    src_index: lane() * int(0),
                    valid: Expr::Bool(true),
                })),
                Stmt::CpAsyncCommit,
            ],
            _ => vec![store("buf", at, cast(Ty::F32, lane() + var("round") * int(32)))],
        };
        let arrive = mbarrier(Mbarrier::Arrive { barrier: full.clone() });
        let producer = match handover {
            Handover::Copies => [write, vec![Stmt::CpAsyncWait(0), arrive]].concat(),
            Handover::ArrivesTwice => [
                write,
                vec![
                    mbarrier(Mbarrier::Arrive {
                        barrier: MbarrierRef::whole("other"),
                    }),
                    arrive,
                ],
            ]
            .concat(),
            Handover::ArrivesFirst => [vec![arrive], write].concat(),
            Handover::OneLaneArrives => [write, vec![if_(eq(lane(), int(0)), vec![arrive])]].concat(),
            _ => [write, vec![arrive]].concat(),
        };
        let wait = mbarrier(Mbarrier::Wait {
            barrier: full.clone(),
            parity: rem(var("round"), int(2)),
        });
        let read = store(
            "out",
            var("round") * int(32) + lane(),
            load("buf", var("round") * int(256) + rem(lane() + int(1), int(32)) * int(8)),
        );
        let consumer = match handover {
            Handover::ConsumersDoNotWait => vec![read],
            _ => vec![wait, read],
        };
        let rounds = |body| vec![for_("round", int(0), int(2), int(1), body)];
        let arrivals = match handover {
            Handover::OneLaneArrives => 1,
            _ => 32,
        };
        let mut k = kernel(
            vec![
                if_(
                    eq(tid(), int(0)),
                    vec![
                        mbarrier(Mbarrier::Init {
                            barrier: full.clone(),
                            count: arrivals,
                        }),
                        mbarrier(Mbarrier::Init {
                            barrier: MbarrierRef::whole("other"),
                            count: 32,
                        }),
                    ],
                ),
                Stmt::SyncThreads,
                Stmt::Roles(Box::new(Roles {
                    roles: vec![
                        Role {
                            cond: eq(warp(), int(0)),
                            body: rounds(consumer),
                        },
                        Role {
                            cond: eq(warp(), int(1)),
                            body: rounds(producer),
                        },
                    ],
                })),
            ],
            vec![
                shared("full", Ty::U32, 2),
                shared("other", Ty::U32, 2),
                shared("buf", Ty::Bf16, 512),
            ],
        );
        k.params[0] = buffer("x", Ty::Bf16, false);
        k
    };
    let x = Array::ints(Ty::Bf16, &[7; 64]);
    for handover in [Handover::Stores, Handover::Copies, Handover::ArrivesTwice] {
        let mut bufs = HashMap::from([("x".into(), x.clone()), ("out".into(), Array::poisoned(Ty::F32, 64))]);
        run(&program(handover), &mut bufs, &HashMap::new()).unwrap_or_else(|e| panic!("{handover:?}: {e}"));
        let want: Vec<f32> = match handover {
            Handover::Copies => vec![7.0; 64],
            _ => (0..64).map(|i| (i / 32 * 32 + (i + 1) % 32) as f32).collect(),
        };
        assert_eq!(bufs["out"].to_f32().unwrap(), want, "{handover:?}");
    }
    for (handover, expected) in [
        (Handover::ArrivesFirst, "without a __syncthreads() between"),
        (Handover::CopiesInFlight, "while a cp.async into it is in flight"),
        (
            Handover::OneLaneArrives,
            "written by thread 33 without a __syncthreads() between",
        ),
        (Handover::ConsumersDoNotWait, "never written"),
    ] {
        let mut bufs = HashMap::from([("x".into(), x.clone()), ("out".into(), Array::poisoned(Ty::F32, 64))]);
        let message = match run(&program(handover), &mut bufs, &HashMap::new()) {
            Err(EmuError::Fault { message, .. }) => message,
            other => panic!("{handover:?}: expected a fault, got {other:?}"),
        };
        assert!(message.contains(expected), "{handover:?}: {message}");
    }
}

/// A role's warpgroups run apart, as on the device: the two warpgroups of one role take turns
/// through mbarriers of their own (warpgroup 0 first, each passing the turn to the other once
/// it wrote its round), which lockstep execution of the role would report as a wait that
/// never completes. Each turn counts the turns before it: a thread reads what its partner in
/// the other warpgroup wrote in the turn before (in shared memory, ordered by the turn's
/// mbarrier alone) and writes one more.
#[test]
fn a_roles_warpgroups_take_turns_through_mbarriers() {
    let turn = |wg: Expr| MbarrierRef {
        array: "turn".into(),
        slot: wg,
    };
    let rounds = 3;
    let body = vec![
        let_("wg", Ty::I32, tid() / int(128)),
        for_(
            "round",
            int(0),
            int(rounds),
            int(1),
            vec![
                if_(
                    lt(int(0), var("round") + var("wg")),
                    vec![mbarrier(Mbarrier::Wait {
                        barrier: turn(var("wg")),
                        parity: rem(var("round") + int(1) + var("wg"), int(2)),
                    })],
                ),
                let_("count", Ty::F32, f(0.0)),
                if_(
                    lt(int(0), var("round") + var("wg")),
                    vec![assign(
                        "count",
                        load(
                            "log",
                            (var("round") - int(1) + var("wg")) * int(256) + rem(tid() + int(128), int(256)),
                        ) + f(1.0),
                    )],
                ),
                store("log", var("round") * int(256) + tid(), var("count")),
                store("out", var("round") * int(256) + tid(), var("count")),
                mbarrier(Mbarrier::Arrive {
                    barrier: turn(int(1) - var("wg")),
                }),
            ],
        ),
    ];
    let mut k = kernel(
        vec![
            if_(
                eq(tid(), int(0)),
                (0..2)
                    .map(|wg| {
                        mbarrier(Mbarrier::Init {
                            barrier: turn(int(wg)),
                            count: 128,
                        })
                    })
                    .collect(),
            ),
            Stmt::SyncThreads,
            Stmt::Roles(Box::new(Roles {
                roles: vec![Role {
                    cond: lt(tid(), int(256)),
                    body,
                }],
            })),
        ],
        vec![
            shared("turn", Ty::U32, 4),
            shared("log", Ty::F32, 256 * rounds as usize),
        ],
    );
    k.block_dim = 256;
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[1.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, 256 * rounds as usize)),
    ]);
    run(&k, &mut bufs, &HashMap::new()).unwrap();
    let want: Vec<f32> = (0..256 * rounds as usize)
        .map(|i| (i / 256 * 2 + i % 256 / 128) as f32)
        .collect();
    assert_eq!(bufs["out"].to_f32().unwrap(), want);
}

/// A block of three warpgroups whose first (a producer) releases registers that the other two
/// (consumers) claim, as FlashAttention-3 moves them (`producer` and `consumers` their
/// statements), each thread storing its index after them. The consumers' role runs first.
fn moving_registers(producer: Vec<Stmt>, consumers: Vec<Stmt>) -> Kernel {
    let stored = || store("out", tid(), cast(Ty::F32, tid()));
    Kernel {
        block_dim: 384,
        ..kernel(
            vec![Stmt::Roles(Box::new(Roles {
                roles: vec![
                    Role {
                        cond: lt(tid(), int(256)),
                        body: [consumers, vec![stored()]].concat(),
                    },
                    Role {
                        cond: bin(BinOp::Ge, tid(), int(256)),
                        body: [producer, vec![stored()]].concat(),
                    },
                ],
            }))],
            vec![],
        )
    }
}

fn set_registers(change: RegisterChange, count: u32) -> Stmt {
    Stmt::SetMaxRegisters { change, count }
}

fn run_moving_registers(k: &Kernel) -> Result<Vec<f32>, String> {
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&[1.0; 64])),
        ("out".into(), Array::poisoned(Ty::F32, 384)),
    ]);
    match run(k, &mut bufs, &HashMap::new()) {
        Ok(_) => Ok(bufs["out"].to_f32().unwrap()),
        Err(e) => Err(e.to_string()),
    }
}

/// `setmaxnreg`: consumers claiming what a producer releases run, the consumers' claims
/// waiting for the release (the consumers' role takes the first turn);
/// claims beyond what the block holds (168 a thread at launch for 384 threads: 24 + 2 × 240
/// is all of it), a warpgroup part of which executes it, moves the wrong way and counts the
/// instruction cannot take are reported (the second consumer warpgroup finds what the first
/// left: 18 432 released, 10 240 claimed).
#[test]
fn registers_move_between_warpgroups_within_the_block() {
    use RegisterChange::{Claim, Release};
    let fitting = moving_registers(vec![set_registers(Release, 24)], vec![set_registers(Claim, 240)]);
    let want: Vec<f32> = (0..384).map(|t| t as f32).collect();
    assert_eq!(run_moving_registers(&fitting), Ok(want));
    assert!(kernels_gen::cuda::emit(&fitting).contains("__launch_bounds__(384, 1)"));

    let too_many = moving_registers(vec![set_registers(Release, 24)], vec![set_registers(Claim, 248)]);
    let err = run_moving_registers(&too_many).unwrap_err();
    assert!(
        err.contains("thread 128: setmaxnreg.inc to 248 waits for 10240 registers, and the block's pool holds 8192"),
        "{err}"
    );
    let nothing_released = moving_registers(vec![], vec![set_registers(Claim, 176)]);
    let err = run_moving_registers(&nothing_released).unwrap_err();
    assert!(
        err.contains("pool holds 0 (168 a thread at launch for 384 threads)"),
        "{err}"
    );

    let one_warp = moving_registers(vec![if_(lt(tid(), int(288)), vec![set_registers(Release, 24)])], vec![]);
    let err = run_moving_registers(&one_warp).unwrap_err();
    assert!(
        err.contains("setmaxnreg by part of warpgroup 2: thread 288 does not execute it"),
        "{err}"
    );
    let partial_block = Kernel {
        block_dim: 288,
        ..moving_registers(vec![set_registers(Release, 24)], vec![])
    };
    let err = run_moving_registers(&partial_block).unwrap_err();
    assert!(err.contains("thread 288 is not in the block"), "{err}");

    let up_by_release = moving_registers(vec![set_registers(Release, 176)], vec![]);
    let err = run_moving_registers(&up_by_release).unwrap_err();
    assert!(
        err.contains("setmaxnreg.dec to 176 registers, more than the 168"),
        "{err}"
    );
    let down_by_claim = moving_registers(vec![set_registers(Release, 24), set_registers(Claim, 16 + 8)], vec![]);
    assert_eq!(run_moving_registers(&down_by_claim).map(|_| ()), Ok(()));
    let down_by_claim = moving_registers(vec![set_registers(Release, 40), set_registers(Claim, 32)], vec![]);
    let err = run_moving_registers(&down_by_claim).unwrap_err();
    assert!(
        err.contains("setmaxnreg.inc to 32 registers, fewer than the 40"),
        "{err}"
    );

    for count in [16, 100, 264] {
        let odd = moving_registers(vec![set_registers(Release, count)], vec![]);
        let err = run_moving_registers(&odd).unwrap_err();
        assert!(
            err.contains(&format!("setmaxnreg to {count} registers: a count is a multiple of 8")),
            "{err}"
        );
    }
}

/// Bytes load four, eight or sixteen at once as integers, each the byte at its place, or as
/// FP8 codes, each its value; such a load off its width's boundary is reported, codes read
/// from anything but bytes and a vector store of bytes are type errors.
#[test]
fn bytes_load_as_words_and_are_never_stored_so() {
    let bytes_kernel = |start: i64, body_after: Vec<Stmt>| Kernel {
        name: "k".into(),
        origin: "test".into(),
        params: vec![buffer("w", Ty::U8, false), buffer("out", Ty::F32, true)],
        shared: vec![],
        block_dim: 4,
        grid: int(1),
        body: [
            vec![load_vec(
                "w",
                tid() * int(4) + int(start),
                &["b0".into(), "b1".into(), "b2".into(), "b3".into()],
            )],
            body_after,
        ]
        .concat(),
    };
    let store_all = vec![
        store("out", tid() * int(4), cast(Ty::F32, var("b0"))),
        store("out", tid() * int(4) + int(1), cast(Ty::F32, var("b1"))),
        store("out", tid() * int(4) + int(2), cast(Ty::F32, var("b2"))),
        store("out", tid() * int(4) + int(3), cast(Ty::F32, var("b3"))),
    ];
    let bytes: Vec<u8> = (0..20usize).map(|i| (200 + 3 * i) as u8).collect();
    let buffers = || {
        HashMap::from([
            ("w".to_string(), Array::u8(&bytes)),
            ("out".to_string(), Array::poisoned(Ty::F32, 16)),
        ])
    };
    let mut bufs = buffers();
    run(&bytes_kernel(0, store_all.clone()), &mut bufs, &HashMap::new()).unwrap();
    let want: Vec<f32> = bytes[..16].iter().map(|&b| f32::from(b)).collect();
    assert_eq!(bufs["out"].to_f32().unwrap(), want);
    match run(&bytes_kernel(2, store_all), &mut buffers(), &HashMap::new()) {
        Err(EmuError::Fault { message, .. }) => assert!(message.contains("misaligned"), "{message}"),
        other => panic!("expected a fault, got {other:?}"),
    }
    // Read as FP8 codes, each byte is its E4M3 value; only bytes are read so.
    let mut codes = bytes_kernel(0, vec![]);
    codes.body = vec![
        load_fp8_codes(
            "w",
            tid() * int(4),
            &["c0".into(), "c1".into(), "c2".into(), "c3".into()],
        ),
        store("out", tid() * int(4), var("c0")),
        store("out", tid() * int(4) + int(1), var("c1")),
        store("out", tid() * int(4) + int(2), var("c2")),
        store("out", tid() * int(4) + int(3), var("c3")),
    ];
    let mut bufs = buffers();
    run(&codes, &mut bufs, &HashMap::new()).unwrap();
    let got = bufs["out"].to_f32().unwrap();
    for (g, &b) in got.iter().zip(&bytes) {
        let want = ir::F8E4M3(b).to_f32();
        assert!(
            g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
            "{b:#x}: {g}"
        );
    }
    codes.params[0] = buffer("w", Ty::F32, false);
    assert!(matches!(
        run(&codes, &mut buffers(), &HashMap::new()),
        Err(EmuError::Type(_))
    ));
    let mut storing = bytes_kernel(0, vec![]);
    storing.params[1] = buffer("out", Ty::U8, true);
    storing.body.push(store_vec(
        "out",
        tid() * int(4),
        vec![var("b0"), var("b1"), var("b2"), var("b3")],
    ));
    assert!(matches!(
        run(&storing, &mut buffers(), &HashMap::new()),
        Err(EmuError::Type(_))
    ));
}
