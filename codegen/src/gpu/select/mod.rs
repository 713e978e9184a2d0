//! Choosing a kernel (a template instance) for every node of a fused graph, and its arguments.
//! The ops that take several launches of their own templates (Gated DeltaNet layers, MoE
//! layers) are chosen in files of their own.

mod delta_net;
mod gemv_tuning;
mod kv_attention;
mod moe;
mod sparse_mla;
mod top_k_rows;

use super::{rows, width, GpuCodegenError, KvLayout, LaunchArg, StateLayout, View, WeightUse, BATCH_ROWS};
use ir::reference::ops::rope_inv_freq;
use ir::{DType, Expr as IrExpr, GluAct, Graph, InputKind, Op};
use kernels_gen::dsl::{Kernel, MmaElement, Ty};
use kernels_gen::templates::cache_layout::CacheLayout;
use kernels_gen::templates::quant::WeightFormat;
use kernels_gen::templates::{self, *};
use std::collections::{BTreeMap, BTreeSet};

/// A GEMM's tiles: (tokens, weight rows, K step).
type Tiles = (usize, usize, usize);

/// A launch as selected: its node, kernel, alternatives and arguments.
pub(crate) type Launched = (usize, Kernel, Alternatives, Vec<LaunchArg>);

pub(crate) struct Selected {
    /// (node, kernel, its alternatives for steps of several rows, arguments).
    pub launches: Vec<Launched>,
    pub views: BTreeMap<usize, View>,
    pub weights: Vec<WeightUse>,
    pub kv_cache: Vec<KvLayout>,
    pub recurrent_states: Vec<StateLayout>,
    pub constants: BTreeMap<String, Vec<f32>>,
    pub token_ids: Option<usize>,
    pub positions: Option<usize>,
    /// The `HiddenStates` input (a row per token, written by the host each step).
    pub hidden_states: Option<usize>,
    /// Whether a launch ranks cached positions through the plan's position scores.
    pub position_scores: bool,
    /// What the KV blocks' positions must be a multiple of (`GpuPlan::block_multiple`).
    pub block_multiple: usize,
}

impl Selected {
    /// The rotation's inverse frequencies as a plan constant (one per theta, rotary width,
    /// spacing and scaling, shared by every launch that rotates so), and the argument naming
    /// it.
    fn rope_inv_freq(&mut self, spec: &ir::RopeSpec) -> LaunchArg {
        let mut name = format!("rope_inv_freq_theta{}_dim{}", spec.theta, spec.rotary_dim);
        if spec.layout == ir::RopeLayout::Proportional {
            name += &format!("_of{}", spec.head_dim);
        }
        if spec.scaling != ir::RopeScaling::None {
            // As the IR text names it, in a constant's characters.
            let text = spec.scaling.describe();
            name += "_";
            name.extend(text.chars().filter(|c| !c.is_whitespace() && *c != ')').map(
                |c| match c.is_ascii_alphanumeric() || c == '.' {
                    true => c,
                    false => '_',
                },
            ));
        }
        self.constants
            .entry(name.clone())
            .or_insert_with(|| rope_inv_freq(spec));
        LaunchArg::Constant { name }
    }
}

/// A launch's kernels for steps of several rows (see [`super::Launch`]).
#[derive(Default)]
pub(crate) struct Alternatives {
    pub few_rows: Option<Kernel>,
    pub prefill: Option<Kernel>,
    /// For steps of `PREFILL_TOKENS` to `BATCH_ROWS` rows, in place of `prefill`.
    pub batch: Option<Kernel>,
}

fn scalar(name: &str, value: impl ToString) -> LaunchArg {
    LaunchArg::Scalar {
        name: name.into(),
        value: value.to_string(),
    }
}

fn weight_format(dtype: DType, node: usize, op: &'static str) -> Result<WeightFormat, GpuCodegenError> {
    WeightFormat::of(dtype).ok_or_else(|| GpuCodegenError::Unsupported {
        node,
        op,
        what: format!(
            "{dtype} weights have no GPU template; compile them converted: `dtype = \"bf16\"` (or \"f32\") \
             under [model] in a model.toml"
        ),
    })
}

/// The name of head `node`, a plain weight (`derived`: what is made from it), or why not.
fn plain_weight(graph: &Graph, node: usize, derived: &str) -> Result<String, String> {
    match &graph.nodes()[node].op {
        Op::Weight { name } => Ok(name.clone()),
        _ => Err(format!("the head must be a plain weight ({derived})")),
    }
}

/// The single-op expression of an elementwise op.
fn as_expr(op: &Op) -> Option<IrExpr> {
    let x = || Box::new(IrExpr::Input(0));
    let y = || Box::new(IrExpr::Input(1));
    Some(match op {
        Op::Add => IrExpr::Add(x(), y()),
        Op::Mul => IrExpr::Mul(x(), y()),
        Op::Scale { factor } => IrExpr::Scale(x(), *factor),
        Op::Silu => IrExpr::Silu(x()),
        Op::GeluTanh => IrExpr::GeluTanh(x()),
        Op::Sigmoid => IrExpr::Sigmoid(x()),
        Op::SoftCap { cap } => IrExpr::SoftCap(x(), *cap),
        Op::Elementwise { expr } => expr.clone(),
        _ => return None,
    })
}

/// A batched step's rows sampled from (its scalar): each sequence's last, or its last
/// `drafts + 1` where it verifies drafted tokens.
const SAMPLED: &str = "sampled";

/// Kernels and arguments for every node, attention and KV appends in cache `layout`.
///
/// `per_sequence` (batched plans): the nodes with a row per sampled row (`last_token`, which
/// gathers the step input `sampled_rows`, and what follows it), whose row count is the step's
/// `sampled`. Scratch is sized for `max_tokens` rows.
pub(crate) fn select(
    graph: &Graph,
    layout: CacheLayout,
    target: crate::Target,
    per_sequence: &BTreeSet<usize>,
    max_tokens: usize,
    chosen: super::PlanKernels,
) -> Result<Selected, GpuCodegenError> {
    let plan = PlanTarget {
        target,
        max_tokens,
        origin: &graph.name,
        prefill: chosen.prefill_gemm,
    };
    let attention = kv_attention::AttentionKernels {
        split: chosen.decode_attention,
        flash: chosen.prefill_attention.flash_form(target),
    };
    let mut s = Selected {
        launches: Vec::new(),
        views: BTreeMap::new(),
        weights: Vec::new(),
        kv_cache: Vec::new(),
        recurrent_states: Vec::new(),
        constants: BTreeMap::new(),
        token_ids: None,
        positions: None,
        hidden_states: None,
        position_scores: false,
        block_multiple: 1,
    };
    let outputs: BTreeSet<usize> = graph.outputs().iter().map(|(_, id)| id.0).collect();
    for (i, node) in graph.nodes().iter().enumerate() {
        let unsupported = |what: String| GpuCodegenError::Unsupported {
            node: i,
            op: node.op.name(),
            what,
        };
        let operands = Operands { graph, node: i };
        let input = |k: usize| operands.input(k);
        let own = View {
            base: i,
            col: 0,
            stride: width(graph, i),
            row: None,
        };
        let act = |s: &Selected, k: usize| operands.activation(s, k);
        let out = operands.out();
        let weight = |k: usize| operands.weight(k);
        match &node.op {
            Op::Input(kind) => {
                match kind {
                    InputKind::TokenIds => s.token_ids = Some(i),
                    InputKind::Positions => s.positions = Some(i),
                    InputKind::HiddenStates => s.hidden_states = Some(i),
                }
                s.views.insert(i, own);
            }
            Op::Weight { .. } | Op::RowGroupSlice { .. } | Op::TransposeRowGroups { .. } => s.weights.push(WeightUse {
                node: i,
                parts: vec![weight_part(graph, ir::NodeId(i))
                    .ok_or_else(|| unsupported("regroups rows of something that is not a weight".into()))?],
                dtype: node.dtype,
                shape: node.shape.resolve(0, 0),
            }),
            Op::ConcatRows => {
                let parts = node
                    .inputs
                    .iter()
                    .map(|p| {
                        weight_part(graph, *p)
                            .ok_or_else(|| unsupported("stacks something that is not a weight".into()))
                    })
                    .collect::<Result<_, _>>()?;
                s.weights.push(WeightUse {
                    node: i,
                    parts,
                    dtype: node.dtype,
                    shape: node.shape.resolve(0, 0),
                });
            }
            // Read in place, but for an output: the host reads outputs as whole rows of a
            // buffer of their own (copied below).
            Op::Slice { start, .. } if !outputs.contains(&i) => {
                let v = s.views[&input(0)].clone();
                s.views.insert(
                    i,
                    View {
                        col: v.col + start,
                        ..v
                    },
                );
            }
            // One sequence: the last row, read in place. A batched step gathers each
            // sequence's last row (below).
            Op::LastToken if layout != CacheLayout::Batched => {
                let v = s.views[&input(0)].clone();
                s.views.insert(
                    i,
                    View {
                        row: Some("tokens-1".into()),
                        ..v
                    },
                );
            }
            op => {
                s.views.insert(i, own);
                let rows = match per_sequence.contains(&i) {
                    true => SAMPLED.to_string(),
                    false => rows(graph, i),
                };
                let (kernel, args) = match op {
                    Op::LastToken => {
                        let (x, stride) = act(&s, 0);
                        let args = vec![
                            x,
                            LaunchArg::StepInput {
                                name: "sampled_rows".into(),
                            },
                            out,
                            scalar("rows", SAMPLED),
                            scalar("width", width(graph, i)),
                            scalar("src_stride", stride),
                        ];
                        let kernel = match node.dtype {
                            DType::I32 => gather::gather_rows_of("gather_positions", &graph.name, Ty::I32),
                            _ => gather::gather_rows("gather_rows", &graph.name),
                        };
                        (kernel, args)
                    }
                    Op::Embedding => {
                        let table = weight_format(graph.node(node.inputs[0]).dtype, i, op.name())?;
                        let (ids, _) = act(&s, 1);
                        let args = vec![
                            weight(0),
                            ids,
                            out,
                            scalar("tokens", &rows),
                            scalar("d", width(graph, i)),
                            scalar("scale", 1.0),
                        ];
                        (embedding::embedding("embedding", &graph.name, table), args)
                    }
                    // Plain, with the norm as its prologue, or with the residual add too
                    // (`[a + b | y]`: the kernels write the sum into the first `k` columns of
                    // each row and the product after it, `gemv::out_index`). The kernels take
                    // the activations (x, and b under a residual), then the weights (the
                    // norm's, then the matrix), as the op's inputs come.
                    Op::MatMul | Op::RmsNormMatMul { .. } | Op::AddRmsNormMatMul { .. } => {
                        let (norm, glu) = match op {
                            Op::RmsNormMatMul { eps, weight_offset } => {
                                (Some(gemv::NormPrologue::new(*eps as f32, *weight_offset)), None)
                            }
                            Op::AddRmsNormMatMul {
                                eps,
                                weight_offset,
                                glu,
                            } => (
                                Some(gemv::NormPrologue::new(*eps as f32, *weight_offset).with_residual()),
                                *glu,
                            ),
                            _ => (None, None),
                        };
                        let m = MatMul::new(graph, i, norm, glu)?;
                        let activations = 1 + usize::from(gemv::residual(norm));
                        let (mut args, strides): (Vec<LaunchArg>, Vec<usize>) =
                            (0..activations).map(|k| act(&s, k)).unzip();
                        args.extend((activations..node.inputs.len()).map(weight));
                        args.extend([
                            out,
                            scalar("tokens", &rows),
                            scalar("n", m.n),
                            scalar("k", m.k),
                            scalar("x_stride", strides[0]),
                        ]);
                        if let Some(b_stride) = strides.get(1) {
                            args.push(scalar("b_stride", b_stride));
                        }
                        let views: Vec<&View> = (0..activations).map(|k| &s.views[&input(k)]).collect();
                        let aligned = aligned(&views);
                        m.push(&mut s, args, aligned, &rows, &plan);
                        continue;
                    }
                    Op::RmsNorm {
                        eps,
                        weight_offset,
                        group,
                    } => {
                        let (x, stride) = act(&s, 0);
                        let w = width(graph, i);
                        let groups = format!("({rows})*{}", w / group);
                        let args = vec![
                            x,
                            weight(1),
                            out,
                            scalar("groups", groups),
                            scalar("group", group),
                            scalar("width", w),
                            scalar("x_stride", stride),
                        ];
                        (
                            rms_norm::rms_norm("rms_norm", &graph.name, *eps as f32, *weight_offset),
                            args,
                        )
                    }
                    Op::UnitRmsNorm { eps, group } => {
                        let (x, stride) = act(&s, 0);
                        let w = width(graph, i);
                        let args = vec![
                            x,
                            out,
                            scalar("groups", format!("({rows})*{}", w / group)),
                            scalar("group", group),
                            scalar("width", w),
                            scalar("x_stride", stride),
                        ];
                        (rms_norm::unit_rms_norm("unit_rms_norm", &graph.name, *eps as f32), args)
                    }
                    Op::SparseMla(spec) => sparse_mla::launches(&mut s, &operands, spec, layout, &rows, max_tokens)?,
                    Op::LayerNorm { eps } => {
                        let (x, stride) = act(&s, 0);
                        let args = vec![
                            x,
                            weight(1),
                            weight(2),
                            out,
                            scalar("rows", &rows),
                            scalar("d", width(graph, i)),
                            scalar("x_stride", stride),
                        ];
                        (rms_norm::layer_norm("layer_norm", &graph.name, *eps as f32), args)
                    }
                    Op::AddRmsNorm { eps, weight_offset } => {
                        let ((a, sa), (b, sb)) = (act(&s, 0), act(&s, 1));
                        let d = width(graph, input(0));
                        let args = vec![
                            a,
                            b,
                            weight(2),
                            out,
                            scalar("rows", &rows),
                            scalar("d", d),
                            scalar("a_stride", sa),
                            scalar("b_stride", sb),
                        ];
                        (
                            rms_norm::add_rms_norm("add_rms_norm", &graph.name, *eps as f32, *weight_offset),
                            args,
                        )
                    }
                    Op::Rope(spec) => {
                        let inv_freq = s.rope_inv_freq(spec);
                        let ((x, stride), (pos, _)) = (act(&s, 0), act(&s, 1));
                        let args = vec![
                            x,
                            pos,
                            inv_freq,
                            out,
                            scalar("tokens", &rows),
                            scalar("width", width(graph, i)),
                            scalar("head_dim", spec.head_dim),
                            scalar("rotary_dim", spec.rotary_dim),
                            scalar("x_stride", stride),
                        ];
                        (rope::rope("rope", &graph.name, rope::Rotation::of(spec)), args)
                    }
                    Op::Attention(_) | Op::RopeAttention { .. } | Op::SharedKvAttention(_) => {
                        kv_attention::launches(&mut s, &operands, layout, &rows, (max_tokens, attention))?
                    }
                    Op::AddBias => {
                        let (x, stride) = act(&s, 0);
                        let w = width(graph, i);
                        let args = vec![
                            x,
                            weight(1),
                            out,
                            scalar("n", format!("({rows})*{w}")),
                            scalar("width", w),
                            scalar("x_stride", stride),
                        ];
                        (elementwise::add_bias("add_bias", &graph.name), args)
                    }
                    Op::ScaleRows => {
                        let (x, x_stride) = act(&s, 0);
                        // A weight (Gemma 4's layer scalar) scales every row alike.
                        let (scalars, s_stride) = match graph.node(node.inputs[1]).op {
                            Op::Weight { .. } => (weight(1), 0),
                            _ => act(&s, 1),
                        };
                        let w = width(graph, i);
                        let args = vec![
                            x,
                            scalars,
                            out,
                            scalar("n", format!("({rows})*{w}")),
                            scalar("width", w),
                            scalar("x_stride", x_stride),
                            scalar("s_stride", s_stride),
                        ];
                        (elementwise::scale_rows("scale_rows", &graph.name), args)
                    }
                    Op::Moe(spec) => {
                        let arch = target.cuda_arch().unwrap_or_default();
                        let chosen = (spec, chosen.prefill_experts);
                        moe::launches(&mut s, &operands, chosen, (&rows, arch), max_tokens)?
                    }
                    Op::Slice { start, len } => {
                        let (x, stride) = act(&s, 0);
                        let args = vec![
                            x,
                            out,
                            scalar("rows", &rows),
                            scalar("width", len),
                            scalar("src_stride", stride),
                            scalar("group", stride),
                            scalar("start", start),
                            scalar("len", len),
                        ];
                        (gather::gather_column_groups("slice", &graph.name), args)
                    }
                    Op::GroupSlice { group, start, len } => {
                        let (x, stride) = act(&s, 0);
                        let args = vec![
                            x,
                            out,
                            scalar("rows", &rows),
                            scalar("width", width(graph, i)),
                            scalar("src_stride", stride),
                            scalar("group", group),
                            scalar("start", start),
                            scalar("len", len),
                        ];
                        (gather::gather_column_groups("group_slice", &graph.name), args)
                    }
                    Op::PermuteColumns => {
                        let (x, stride) = act(&s, 0);
                        let args = vec![
                            x,
                            weight(1),
                            out,
                            scalar("rows", &rows),
                            scalar("width", width(graph, i)),
                            scalar("src_stride", stride),
                        ];
                        (gather::gather_columns("gather_columns", &graph.name), args)
                    }
                    Op::ConcatColumns => {
                        let ((a, a_stride), (b, b_stride)) = (act(&s, 0), act(&s, 1));
                        let args = vec![
                            a,
                            b,
                            out,
                            scalar("rows", &rows),
                            scalar("width", width(graph, i)),
                            scalar("a_width", width(graph, input(0))),
                            scalar("a_stride", a_stride),
                            scalar("b_stride", b_stride),
                        ];
                        (gather::concat_columns("concat_columns", &graph.name), args)
                    }
                    Op::GatedDeltaNet(spec) => {
                        let form = chosen.prefill_delta_rule;
                        delta_net::launches(&mut s, &operands, (spec, form), layout, &rows, max_tokens)?
                    },
                    Op::Glu { act: a } => {
                        let (x, stride) = act(&s, 0);
                        let args = vec![
                            x,
                            out,
                            scalar("tokens", &rows),
                            scalar("n", width(graph, i)),
                            scalar("x_stride", stride),
                        ];
                        (glu::glu("glu", &graph.name, *a), args)
                    }
                    // Its kernels score one row: a batched step takes the logits' top-k instead.
                    Op::Int8BoundTopK { .. } if layout == CacheLayout::Batched => {
                        return Err(unsupported(
                            "the INT8-bound head scores one row a step; a batched plan takes `top_k` of the logits (`models::with_greedy_token`)".into(),
                        ))
                    }
                    Op::Int8BoundTopK { k: 1, soft_cap } => {
                        let head_name = plain_weight(graph, input(1), "its INT8 rows are derived from it")
                            .map_err(unsupported)?;
                        let w = weight_format(graph.nodes()[input(1)].dtype, i, op.name())?;
                        let (h, _) = act(&s, 0);
                        let d = width(graph, input(0));
                        let vocab = graph.nodes()[input(1)].shape.resolve(0, 0)[0];
                        let blocks = d.div_ceil(32);
                        let partials = vocab.div_ceil(256);
                        let scratch = |name: &str, bytes: usize| LaunchArg::Scratch {
                            node: i,
                            name: name.into(),
                            bytes,
                        };
                        let derived = |tensor: &str| LaunchArg::Derived {
                            weight: head_name.clone(),
                            tensor: tensor.into(),
                        };
                        let steps: Vec<(Kernel, Vec<LaunchArg>)> = vec![
                            (
                                int8_head::quantize_h("int8_quantize_h", &graph.name),
                                vec![
                                    h.clone(),
                                    scratch("qh", d),
                                    scratch("hs", blocks * 4),
                                    scratch("he", blocks * 4),
                                    scratch("hn", blocks * 4),
                                    scalar("d", d),
                                ],
                            ),
                            (
                                int8_head::score("int8_score", &graph.name),
                                vec![
                                    derived("q"),
                                    derived("scale"),
                                    derived("err_norm"),
                                    derived("quant_norm"),
                                    derived("norm"),
                                    scratch("qh", d),
                                    scratch("hs", blocks * 4),
                                    scratch("he", blocks * 4),
                                    scratch("hn", blocks * 4),
                                    scratch("lower", vocab * 4),
                                    scratch("upper", vocab * 4),
                                    scalar("rows", vocab),
                                    scalar("d", d),
                                ],
                            ),
                            (
                                int8_head::max_reduce("max_reduce", &graph.name),
                                vec![
                                    scratch("lower", vocab * 4),
                                    scratch("partial", partials * 4),
                                    scalar("n", vocab),
                                ],
                            ),
                            (
                                int8_head::max_reduce("max_reduce", &graph.name),
                                vec![
                                    scratch("partial", partials * 4),
                                    scratch("tau", 4),
                                    scalar("n", partials),
                                ],
                            ),
                            (
                                int8_head::rescore("int8_rescore", &graph.name, w, *soft_cap),
                                vec![
                                    h,
                                    weight(1),
                                    scratch("upper", vocab * 4),
                                    scratch("tau", 4),
                                    scratch("rescored", vocab * 4),
                                    scalar("rows", vocab),
                                    scalar("k", d),
                                ],
                            ),
                        ];
                        for (kernel, args) in steps {
                            s.launches.push((i, kernel, Alternatives::default(), args));
                        }
                        let args = vec![
                            scratch("rescored", vocab * 4),
                            out,
                            scalar("rows", 1),
                            scalar("v", vocab),
                            scalar("k", 1),
                        ];
                        (top_k::top_k("argmax", &graph.name), args)
                    }
                    // A 4-bit copy of the head (made where the plan loads) scores every row,
                    // the best `candidates` are picked in one pass over the scores, the full
                    // head rescores those.
                    Op::ShortlistTopK { k: 1, candidates } => {
                        let head_name =
                            plain_weight(graph, input(1), "its 4-bit copy is made from it").map_err(unsupported)?;
                        let w = weight_format(graph.nodes()[input(1)].dtype, i, op.name())?;
                        let (h, h_stride) = act(&s, 0);
                        let d = width(graph, input(0));
                        let vocab = graph.nodes()[input(1)].shape.resolve(0, 0)[0];
                        let c = (*candidates).min(vocab);
                        let scores = operands.scratch("coarse", vocab, max_tokens);
                        let shortlist = operands.scratch("candidates", c, max_tokens);
                        let exact = operands.scratch("exact", c, max_tokens);
                        let coarse = gemv::GemvSpec::decode(WeightFormat::Blocks(DType::Q4_0), d);
                        let coarse_scores = (
                            gemv::gemv("shortlist_coarse", &graph.name, coarse),
                            vec![
                                h.clone(),
                                LaunchArg::Derived {
                                    weight: head_name,
                                    tensor: gpu_plan::SHORTLIST_TENSOR.into(),
                                },
                                scores.clone(),
                                scalar("tokens", &rows),
                                scalar("n", vocab),
                                scalar("k", d),
                                scalar("x_stride", h_stride),
                            ],
                        );
                        let pick = top_k_rows::launches(
                            "shortlist_top_k",
                            &graph.name,
                            (scores, shortlist.clone()),
                            &rows,
                            (vocab, c),
                            &|name, per_row| operands.scratch(name, per_row, max_tokens),
                        );
                        let rescore = (
                            shortlist::rescore("shortlist_rescore", &graph.name, w),
                            vec![
                                h,
                                weight(1),
                                shortlist.clone(),
                                exact.clone(),
                                scalar("items", format!("({rows})*{c}")),
                                scalar("c", c),
                                scalar("k", d),
                                scalar("h_stride", h_stride),
                            ],
                        );
                        for (kernel, args) in std::iter::once(coarse_scores).chain(pick).chain([rescore]) {
                            s.launches.push((i, kernel, Alternatives::default(), args));
                        }
                        let args = vec![exact, shortlist, out, scalar("rows", &rows), scalar("c", c)];
                        (shortlist::best("shortlist_best", &graph.name), args)
                    }
                    Op::TopK { k } => {
                        let (logits, _) = act(&s, 0);
                        let v = width(graph, input(0));
                        let mut launches = top_k_rows::launches(
                            "top_k",
                            &graph.name,
                            (logits, out),
                            &rows,
                            (v, *k),
                            &|name, per_row| operands.scratch(name, per_row, max_tokens),
                        );
                        let own = launches.pop().expect("at least one launch");
                        for (kernel, args) in launches {
                            s.launches.push((i, kernel, Alternatives::default(), args));
                        }
                        own
                    }
                    op => match as_expr(op) {
                        Some(expr) => {
                            let w = width(graph, i);
                            let mut args: Vec<LaunchArg> = (0..node.inputs.len()).map(|k| act(&s, k).0).collect();
                            args.push(out);
                            args.push(scalar("n", format!("({rows})*{w}")));
                            args.push(scalar("width", w));
                            args.extend((0..node.inputs.len()).map(|k| scalar(&format!("in{k}_stride"), act(&s, k).1)));
                            (elementwise::elementwise("elementwise", &graph.name, &expr), args)
                        }
                        None => return Err(unsupported("no GPU template yet".into())),
                    },
                };
                s.launches.push((i, kernel, Alternatives::default(), args));
            }
        }
    }
    Ok(s)
}

/// Node `id` as a part of a weight the plan uploads: a weight, or a row regrouping of one
/// (transposed or not).
fn weight_part(graph: &Graph, id: ir::NodeId) -> Option<super::WeightPart> {
    match &graph.node(id).op {
        Op::Weight { name } => Some(super::WeightPart::Whole(name.clone())),
        &Op::RowGroupSlice { group, start, len } => match &graph.node(graph.node(id).inputs[0]).op {
            Op::Weight { name } => Some(super::WeightPart::RowGroups {
                name: name.clone(),
                group,
                start,
                len,
            }),
            _ => None,
        },
        &Op::TransposeRowGroups { group, start, len } => match &graph.node(graph.node(id).inputs[0]).op {
            Op::Weight { name } => Some(super::WeightPart::TransposedRowGroups {
                name: name.clone(),
                group,
                start,
                len,
                transposed: super::Transposed::YES,
            }),
            _ => None,
        },
        _ => None,
    }
}

/// A node's operands as launch arguments.
struct Operands<'g> {
    graph: &'g Graph,
    node: usize,
}

impl Operands<'_> {
    fn input(&self, k: usize) -> usize {
        self.graph.nodes()[self.node].inputs[k].0
    }

    /// Input `k`, an activation, where its view lies, and its row stride.
    fn activation(&self, s: &Selected, k: usize) -> (LaunchArg, usize) {
        let v = &s.views[&self.input(k)];
        (
            LaunchArg::Activation {
                node: v.base,
                offset: v.offset(),
            },
            v.stride,
        )
    }

    /// Input `k`, a weight.
    fn weight(&self, k: usize) -> LaunchArg {
        LaunchArg::Weight { node: self.input(k) }
    }

    /// Input `k`'s storage as the kernels read it (or why they cannot).
    fn weight_format(&self, k: usize) -> Result<WeightFormat, GpuCodegenError> {
        let op = &self.graph.nodes()[self.node].op;
        weight_format(self.graph.nodes()[self.input(k)].dtype, self.node, op.name())
    }

    /// The node's own value.
    fn out(&self) -> LaunchArg {
        LaunchArg::Activation {
            node: self.node,
            offset: "0".into(),
        }
    }

    /// Scratch of the node's launches: `per_row` f32 values for each of `max_tokens` rows.
    fn scratch(&self, name: &str, per_row: usize, max_tokens: usize) -> LaunchArg {
        LaunchArg::Scratch {
            node: self.node,
            name: name.into(),
            bytes: max_tokens * per_row * 4,
        }
    }

    fn origin(&self) -> &str {
        &self.graph.name
    }
}

/// What the launches of one plan share.
struct PlanTarget<'a> {
    target: crate::Target,
    /// Rows scratch is sized for.
    max_tokens: usize,
    /// The graph's name, for the kernels' origin lines.
    origin: &'a str,
    /// The GEMM bf16 matmuls prefill through.
    prefill: super::PrefillGemm,
}

/// The most bytes a matrix's bf16 copy for a prefill step may take (GGUF blocks converted for
/// the TMA GEMM; see `MatMul::converted_for_prefill`): the copy lives in the step's scratch,
/// so this bounds what it takes from the KV cache. Every projection of a 70B model fits; a
/// 128k-vocabulary head does not (its prompts compute a row or two a sequence).
const CONVERTED_WEIGHTS_BYTES: usize = 512 << 20;

/// A matmul's kernels (see `MatMul::kernels`).
struct MatMulKernels {
    decode: Kernel,
    few_rows: Kernel,
    prefill: Kernel,
    batch: Option<Kernel>,
    /// The prefill GEMM's tiles and whether it gates a GLU's products itself.
    tiles: Option<(Tiles, bool)>,
    /// The batch GEMM's tiles where they are not the prefill GEMM's.
    batch_tiles: Option<Tiles>,
}

/// A matmul node as its kernels see it: the weights, the prologue (a norm, perhaps after a
/// residual add) and epilogue (a GLU), K, and the weight rows `n` (a joined gate/up's under a
/// GLU epilogue: twice the product's columns).
struct MatMul {
    node: usize,
    weights: WeightFormat,
    norm: Option<gemv::NormPrologue>,
    glu: Option<GluAct>,
    k: usize,
    n: usize,
}

impl MatMul {
    /// Node `node`, whose last input is its weights and first its activation.
    fn new(
        graph: &Graph,
        node: usize,
        norm: Option<gemv::NormPrologue>,
        glu: Option<GluAct>,
    ) -> Result<Self, GpuCodegenError> {
        let op = &graph.node(ir::NodeId(node)).op;
        let inputs = &graph.node(ir::NodeId(node)).inputs;
        let w = graph.node(*inputs.last().expect("a matmul has weights"));
        let weights = weight_format(w.dtype, node, op.name())?;
        if glu.is_some() && !matches!(weights, WeightFormat::Dense(_)) {
            return Err(GpuCodegenError::Unsupported {
                node,
                op: op.name(),
                what: format!("a GLU epilogue over {weights:?} weights"),
            });
        }
        Ok(Self {
            node,
            weights,
            norm,
            glu,
            k: width(graph, inputs[0].0),
            n: w.shape.resolve(0, 0)[0],
        })
    }

    /// The stem its kernels' names share: `rms_norm_gemv`, `add_rms_norm_swiglu_gemm`, ….
    fn stem(&self) -> String {
        let prologue = match self.norm {
            Some(norm) if norm.residual => "add_rms_norm_",
            Some(_) => "rms_norm_",
            None => "",
        };
        match self.glu {
            Some(act) => format!("{prologue}{}_", Op::Glu { act }.name()),
            None => prologue.into(),
        }
    }

    /// The decode GEMV (16-byte activation loads where every activation row is `aligned`),
    /// the GEMV carrying 4 rows a pass, and for prefill the target's tensor-core GEMM (with
    /// the tiles its K splits count in, and whether it gates a GLU's products itself) where it
    /// has one for these weights (and this prologue and epilogue), else that GEMV; over
    /// weights converted for prefill, for steps of up to `BATCH_ROWS` rows the GEMM that
    /// takes the stored form into its tiles, over the same bf16 rows as the TMA GEMM, with its
    /// tiles.
    fn kernels(&self, plan: &PlanTarget, aligned: bool) -> MatMulKernels {
        let (arch, origin) = (plan.target.cuda_arch().unwrap_or_default(), plan.origin);
        let sms = plan.target.multiprocessors();
        let mut spec = gemv::GemvSpec::decode(self.weights, self.k);
        if let Some(norm) = self.norm {
            spec = spec.with_norm(norm).with_prefetch_steps(gemv_tuning::prefetch_steps());
        }
        if let Some(act) = self.glu {
            spec = spec.with_glu(act);
        }
        if aligned {
            spec = spec.with_x_vectors();
        }
        let gemv_name = format!("{}gemv", self.stem());
        let cols = if self.glu.is_some() { self.n / 2 } else { self.n };
        let few_rows = gemv::gemv(&gemv_name, origin, gemv_tuning::shaped(spec.prefill(), cols, sms));
        let gemm_name = format!("{}gemm", self.stem());
        let (gemm, batch, batch_tiles) = match (self.takes_tma(plan), self.converted_for_prefill(plan)) {
            (true, _) | (_, Some(_)) => {
                use templates::TmaSchedule;
                let schedule = match plan.prefill {
                    super::PrefillGemm::Specialised => TmaSchedule::Specialised,
                    super::PrefillGemm::Persistent => TmaSchedule::Persistent { blocks: sms as u32 },
                    _ => TmaSchedule::BlockDriven,
                };
                // The name says where a block takes tiles in turn.
                let persistent = matches!(schedule, TmaSchedule::Persistent { .. }) && TmaSchedule::has_forms(arch);
                let name = format!("{gemm_name}_tma{}", if persistent { "_persistent" } else { "" });
                let form = (self.norm, self.glu);
                match self.converted_for_prefill(plan) {
                    // Steps of many rows multiply by the step's bf16 copy; batches decode.
                    Some(_) => {
                        let converted = format!("{name}_converted");
                        let gemm = templates::tma_prefill_gemm(arch, form, schedule, &converted, origin).map(|g| {
                            PrefillGemm {
                                kernel: tma_gemm::over_converted_weights(g.kernel, &converted),
                                ..g
                            }
                        });
                        let decoding = self.decoding_after_rows(plan, &gemm_name).map(|g| g.kernel);
                        (gemm, decoding, Some(gemm_mma::TILES))
                    }
                    None => {
                        let batch_name = format!("{name}_batch");
                        // Half weights multiplied as stored, over rows made half.
                        let element = |kernel: Kernel| halves::multiplying(self.element(), kernel);
                        (
                            templates::tma_prefill_gemm(arch, form, schedule, &name, origin).map(|g| PrefillGemm {
                                kernel: element(g.kernel),
                                ..g
                            }),
                            templates::tma_batch_gemm(arch, form, schedule, BATCH_ROWS as u32, (&batch_name, origin))
                                .map(element),
                            None,
                        )
                    }
                }
            }
            // Weights not copied: every step of many rows decodes, after the rows.
            (false, None) if self.decoding_staging(plan).is_some() => {
                (self.decoding_after_rows(plan, &gemm_name), None, None)
            }
            (false, None) => (
                templates::prefill_gemm(arch, self.weights, self.k, self.norm, self.glu, &gemm_name, origin),
                None,
                None,
            ),
        };
        let (prefill, tiles) = match gemm {
            Some(gemm) => (gemm.kernel, Some((gemm.tiles, gemm.gates))),
            None => (few_rows.clone(), None),
        };
        let decode = gemv::gemv(&gemv_name, origin, gemv_tuning::shaped(spec, cols, sms));
        MatMulKernels {
            decode,
            few_rows,
            prefill,
            batch,
            tiles,
            batch_tiles,
        }
    }

    /// The decoding GEMM over the rows `bf16_rows` makes ([`Self::decoding_staging`]), named
    /// after `gemm_name`: its products through the partials (the reduction gates a GLU's).
    fn decoding_after_rows(&self, plan: &PlanTarget, gemm_name: &str) -> Option<PrefillGemm> {
        let staging = self.decoding_staging(plan)?;
        let name = format!("{gemm_name}_after_rows");
        Some(PrefillGemm {
            kernel: gemm_mma::gemm_mma_after_rows(&name, plan.origin, staging, (self.norm, self.glu)),
            tiles: gemm_mma::TILES,
            gates: false,
        })
    }

    /// Whether its prefill GEMM is the target's TMA GEMM (bf16 or half weights, rows of whole
    /// 16-byte chunks), its activation rows made of the weights' type ([`Self::element`]),
    /// prologue applied, by a launch before it (`bf16_rows::rows_of`).
    fn takes_tma(&self, plan: &PlanTarget) -> bool {
        plan.prefill.is_tma()
            && plan.target.cuda_arch().is_some()
            && matches!(self.weights, WeightFormat::Dense(Ty::Bf16 | Ty::F16))
            && self.k.is_multiple_of(8)
    }

    /// The type its tensor-core GEMMs multiply in: half weights as stored (their rows rounded
    /// to half: `halves::over_halves`), bf16 for the others.
    fn element(&self) -> MmaElement {
        match self.weights {
            WeightFormat::Dense(Ty::F16) => MmaElement::F16,
            _ => MmaElement::Bf16,
        }
    }

    /// How the decoding GEMM over bf16 rows (`gemm_mma_after_rows`) takes these weights into
    /// its tiles, where it is their tensor-core GEMM: GGUF blocks decoded, on a CUDA target
    /// whose plans make activation rows bf16 for the TMA GEMMs (half weights go to the TMA
    /// GEMMs as they are: [`Self::takes_tma`]). At up to `BATCH_ROWS` rows of weights
    /// [`Self::converted_for_prefill`], and at any rows of others (too large to copy, or a
    /// plan of few rows), it multiplies by the rows `bf16_rows` made, the prologue applied
    /// once a step rather than by each block of columns.
    fn decoding_staging(&self, plan: &PlanTarget) -> Option<gemm_mma::WeightStaging> {
        let staging = match self.weights {
            WeightFormat::Blocks(format) => gemm_mma::WeightStaging::Dequantize(format),
            _ => return None,
        };
        (plan.prefill.is_tma() && plan.target.cuda_arch().is_some()).then_some(staging)
    }

    /// The stored format of weights that steps of more than `BATCH_ROWS` rows convert into a
    /// bf16 copy for the target's TMA GEMM (a `weight_convert` launch before it): those the
    /// decoding GEMM takes ([`Self::decoding_staging`]), where the target has a TMA GEMM and the
    /// copy fits [`CONVERTED_WEIGHTS_BYTES`].
    /// Such a step multiplies each weight by as many rows as a bf16 model's prompt does, on
    /// the same GEMM, for the copy's cost: writing and reading 2 bytes a weight. Fewer rows
    /// keep the GEMM that takes the stored form into its tiles.
    fn converted_for_prefill(&self, plan: &PlanTarget) -> Option<DType> {
        let gemm_mma::WeightStaging::Dequantize(format) = self.decoding_staging(plan)? else {
            return None;
        };
        let fits = self.n * self.k * 2 <= CONVERTED_WEIGHTS_BYTES;
        let arch = plan.target.cuda_arch().unwrap_or_default();
        let many_rows = plan.max_tokens > BATCH_ROWS;
        (fits && many_rows && templates::has_tma_gemm(arch)).then_some(format)
    }

    /// The position of the weight matrix in its launches' arguments (the GEMV's: activations,
    /// the residual, the norm's weight, then the matrix).
    fn matrix_arg(&self) -> usize {
        1 + usize::from(gemv::residual(self.norm)) + usize::from(self.norm.is_some())
    }

    /// Its launches: the GEMV with its alternatives for steps of a few and of many rows, and
    /// after a GEMM that splits K the reduction of its partials. The GEMM
    /// takes the partials and the split count after the GEMV's arguments (which the GEMV does
    /// not read); the TMA GEMM then its bf16 rows, which a launch before it makes at steps
    /// of its rows (the prologue's work, which the GEMM then does not do), and over converted
    /// weights the copy a launch before that makes.
    fn push(self, s: &mut Selected, args: Vec<LaunchArg>, aligned: bool, rows: &str, plan: &PlanTarget) {
        let i = self.node;
        let sms = plan.target.multiprocessors();
        let converted = self.converted_for_prefill(plan);
        let tma = self.takes_tma(plan);
        // Steps of many rows multiply by rows `bf16_rows` makes: the TMA GEMMs', and the
        // decoding GEMM's over weights in a stored form.
        let after_rows = tma || self.decoding_staging(plan).is_some();
        let kernels = self.kernels(plan, aligned);
        let alternatives = Alternatives {
            few_rows: Some(kernels.few_rows),
            prefill: Some(kernels.prefill),
            batch: kernels.batch,
        };
        let Some((tiles, gates)) = kernels.tiles else {
            s.launches.push((i, kernels.decode, alternatives, args));
            return;
        };
        let (n, k) = (self.n, self.k);
        // The GEMMs' tilings: the prefill GEMM's, and over converted weights the decoding
        // GEMM's (up to `BATCH_ROWS` rows).
        let tilings: Vec<Tiles> = [Some(tiles), kernels.batch_tiles].into_iter().flatten().collect();
        let mut partial_len = tilings
            .iter()
            .map(|&tiles| split_k::partial_len(n, k, tiles, sms))
            .max()
            .expect("a tiling");
        if self.glu.is_some() && !gates {
            // Every product goes through the partials, in one split too: room for every row.
            partial_len = partial_len.max(plan.max_tokens * n);
        }
        // The norm the GEMM's splits still scale by (rows made before the GEMM come
        // normalised).
        let norm = self.norm.filter(|_| !after_rows);
        if norm.is_some() {
            // The splits' sums of squares after the products.
            partial_len = prologue_norms::partial_len(partial_len, n);
        }
        let partial = LaunchArg::Scratch {
            node: i,
            name: "partial".into(),
            bytes: partial_len * 4,
        };
        let splits = match kernels.batch_tiles {
            Some(decoding) => {
                // The decoding GEMM's splits up to `BATCH_ROWS` rows, the TMA GEMM's beyond.
                let beyond = format!("min(1, max(0, ({rows}) - {BATCH_ROWS}))");
                format!(
                    "{beyond} * ({}) + (1 - {beyond}) * ({})",
                    split_k::splits_expr(rows, n, k, tiles, sms),
                    split_k::splits_expr(rows, n, k, decoding, sms)
                )
            }
            None => split_k::splits_expr(rows, n, k, tiles, sms),
        };
        let mut args = [args, vec![partial.clone(), scalar("splits", &splits)]].concat();
        if let Some(format) = converted {
            let wb = LaunchArg::Scratch {
                node: i,
                name: "wb".into(),
                bytes: n * k * 2,
            };
            let convert = weight_convert::to_bf16_for_prefill(format, BATCH_ROWS + 1, plan.origin)
                .expect("a format converted for prefill");
            let convert_args = vec![
                args[self.matrix_arg()].clone(),
                wb.clone(),
                scalar("n", n),
                scalar("k", k),
                scalar("tokens", rows),
            ];
            s.launches.push((i, convert, Alternatives::default(), convert_args));
            let (rows_launch, gemm_rows) = self.rows_launch(&args, rows, plan);
            s.launches.push(rows_launch);
            args.extend(gemm_rows);
            args.push(wb);
        } else if after_rows {
            let (rows_launch, gemm_rows) = self.rows_launch(&args, rows, plan);
            s.launches.push(rows_launch);
            args.extend(gemm_rows);
        }
        s.launches.push((i, kernels.decode, alternatives, args));
        let one_split = tilings.iter().all(|&tiles| split_k::most_splits(n, k, tiles, sms) == 1);
        if one_split && self.glu.is_none() {
            return;
        }
        // Into the product's columns of the output's rows: after the sum under a residual
        // prologue.
        let (out_col, cols) = match self.norm {
            Some(norm) if norm.residual => (k, k + self.product_cols()),
            _ => (0, self.product_cols()),
        };
        let mut reduce_args = vec![
            partial,
            LaunchArg::Activation {
                node: i,
                offset: "0".into(),
            },
            scalar("tokens", rows),
            scalar("n", n),
            scalar("splits", splits),
            scalar("out_stride", cols),
            scalar("out_col", out_col),
        ];
        if norm.is_some() {
            reduce_args.push(scalar("k", k));
        }
        let reduce = |gates: bool| match (self.glu, gates) {
            (Some(act), true) => {
                split_k::reduce_after_gating("split_k_reduce", plan.origin, super::PREFILL_TOKENS, act)
            }
            _ => split_k::reduce("split_k_reduce", plan.origin, super::PREFILL_TOKENS, self.glu, norm),
        };
        // (Weights converted for prefill are GGUF blocks, which take no GLU epilogue: a batch
        // GEMM beside a TMA GEMM never leaves a GLU's products to the reduction.)
        s.launches
            .push((i, reduce(gates), Alternatives::default(), reduce_args));
    }

    /// The launch making the TMA GEMM's rows (bf16, or half for half weights) from the
    /// matmul's arguments `args` (the GEMV's: activations, the norm's weight, the matrix,
    /// `out`, the sizes and strides), and the arguments that hand them to the GEMM (the rows
    /// and their stride).
    fn rows_launch(&self, args: &[LaunchArg], rows: &str, plan: &PlanTarget) -> (Launched, [LaunchArg; 2]) {
        let residual = gemv::residual(self.norm);
        let matrix = self.matrix_arg();
        let (out, x_stride) = (&args[matrix + 1], &args[matrix + 5]);
        let xb_stride = self.k.next_multiple_of(8);
        let xb = LaunchArg::Scratch {
            node: self.node,
            name: "xb".into(),
            bytes: plan.max_tokens * xb_stride * 2,
        };
        let mut launch_args: Vec<LaunchArg> = args[..matrix].to_vec();
        launch_args.push(xb.clone());
        if residual {
            launch_args.push(out.clone());
        }
        launch_args.extend([
            scalar("tokens", rows),
            scalar("k", self.k),
            x_stride.clone(),
            scalar("xb_stride", xb_stride),
        ]);
        if residual {
            launch_args.extend([
                args[matrix + 6].clone(),
                scalar("out_stride", self.k + self.product_cols()),
            ]);
        }
        // Named for the prologue and the rows' type alone: the rows do not depend on the
        // epilogue.
        let prologue = match self.norm {
            Some(norm) if norm.residual => "add_rms_norm_",
            Some(_) => "rms_norm_",
            None => "",
        };
        let element = self.element();
        let name = format!("{prologue}{}_rows", element.ptx());
        let kernel = bf16_rows::rows_of(element, &name, plan.origin, self.norm, super::PREFILL_TOKENS);
        let launch = (self.node, kernel, Alternatives::default(), launch_args);
        (launch, [xb, scalar("xb_stride", xb_stride)])
    }

    /// The product's columns.
    fn product_cols(&self) -> usize {
        match self.glu {
            Some(_) => self.n / 2,
            None => self.n,
        }
    }
}

/// The most weight bytes attention prefetches for the projection after it: room in every
/// target's L2 (50 MB on H200) beside the cache rows a few-row step reads.
const PREFETCH_BUDGET: usize = 24 << 20;

/// Rows at most for which attention prefetches: beyond, the steps' cache reads fill L2.
const PREFETCH_ROWS: usize = 4;

/// The weights (node) of the matmul reading attention node `i`'s output, the output
/// projection, and their bytes: what attention's split pass prefetches into L2
/// (`templates::weight_prefetch`).
fn next_matmul_weights(graph: &Graph, i: usize) -> Option<(usize, usize)> {
    let matmul = graph
        .nodes()
        .iter()
        .find(|n| matches!(n.op, Op::MatMul) && n.inputs.first().is_some_and(|x| x.0 == i))?;
    let w = *matmul.inputs.last()?;
    let node = graph.node(w);
    let format = WeightFormat::of(node.dtype)?;
    let elements: usize = node.shape.resolve(0, 0).iter().product();
    Some((w.0, format.buffer_len(elements) * format.buffer_ty().bytes()))
}

/// The `prefetch_bytes` scalar of a step of `rows` rows: up to [`PREFETCH_BUDGET`] of the
/// `bytes` at [`PREFETCH_ROWS`] rows or fewer, none beyond, and none where the runtime's
/// `prefetch` is 0 (switched off).
fn prefetch_bytes(rows: &str, bytes: usize) -> String {
    format!(
        "prefetch*min(1,{PREFETCH_ROWS}/({rows}))*{}",
        bytes.min(PREFETCH_BUDGET)
    )
}

/// Whether every row of every view starts 16-byte aligned (the GEMVs then read activations
/// with 16-byte loads): the arena is aligned (`plan::ALIGN`), so each view's column and row
/// stride must be multiples of 4 floats.
fn aligned(views: &[&View]) -> bool {
    views
        .iter()
        .all(|v| v.col.is_multiple_of(4) && v.stride.is_multiple_of(4))
}

#[cfg(test)]
mod tests {
    use super::super::expr::{eval, Value};
    use kernels_gen::templates::split_k::{partial_len, splits_expr, MAX_SPLITS};
    use std::collections::HashMap;

    fn splits(expr: &str, tokens: i64) -> i64 {
        eval(expr, &HashMap::from([("tokens", Value::Int(tokens))]))
            .unwrap()
            .as_i64()
    }

    /// The split count: many at few rows over few weight tiles, one at many rows, never more
    /// than K has steps, and always within the partials.
    #[test]
    fn split_k_fills_the_gpu_within_the_partials() {
        let tiles = kernels_gen::templates::gemm_wgmma::TILES;
        // 8B QKV (48 weight tiles) on 132 SMs: 264 / 48 = 5 splits at one row tile.
        let qkv = splits_expr("tokens", 6144, 4096, tiles, 132);
        assert_eq!(splits(&qkv, 16), 5);
        assert_eq!(splits(&qkv, 64), 5);
        assert_eq!(splits(&qkv, 65), 2);
        assert_eq!(splits(&qkv, 512), 1);
        // A wide head fills the GPU alone: never split, and no partials.
        assert_eq!(splits(&splits_expr("tokens", 128256, 4096, tiles, 132), 16), 1);
        assert_eq!(partial_len(128256, 4096, tiles, 132), 1);
        // K of three steps: three splits at most.
        assert_eq!(splits(&splits_expr("tokens", 64, 160, tiles, 132), 16), 3);
        // Hopper's and Blackwell's tiles, on an H200's and a B200's SMs.
        let gemms = [(tiles, 132), (kernels_gen::templates::gemm_tcgen05::TILES, 148)];
        for ((n, k), (tiles, sms)) in [(300, 8192), (64, 160), (6144, 4096), (4096, 14336)]
            .into_iter()
            .flat_map(|shape| gemms.map(|gemm| (shape, gemm)))
        {
            let expr = splits_expr("tokens", n, k, tiles, sms);
            let room = partial_len(n, k, tiles, sms) as i64;
            for tokens in 1..=600 {
                let s = splits(&expr, tokens);
                assert!((1..=MAX_SPLITS as i64).contains(&s));
                assert!(
                    s == 1 || s * tokens * n as i64 <= room,
                    "{n}×{k}: {tokens} rows, {s} splits"
                );
            }
        }
    }
}
