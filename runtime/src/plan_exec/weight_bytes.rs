//! A weight as a plan's kernels read it: its parts (their rows) stacked by rows, converted to
//! the plan's dtype (f32, bf16, f16) or kept as stored (its own floats, GGUF blocks).
//!
//! Loading is most of the time from `bbc serve` to a first answer, so: a weight already in
//! the plan's form and taken whole (a bf16 checkpoint's tensors into a bf16 plan, GGUF
//! blocks) is handed to the upload as it lies in the file's mapping, with no copy on the
//! host; every other is written straight into its buffer, its rows converted a chunk at a
//! time on every core. Where the device converts a weight's stored form instead
//! (`device_convert`), [`stored_runs`] gives its rows as stored.

use crate::{Result, RuntimeError};
use gpu_plan::WeightPart;
use half::bf16;
use ir::DType;
use quant::tensor::{TensorView, Tensors};
use quant::GgmlType;
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

/// Output bytes one task converts: large enough that scheduling it costs nothing, small
/// enough that its f32 values stay in cache.
const CHUNK_BYTES: usize = 1 << 18;

thread_local! {
    /// A task's rows as f32 values, between decoding and encoding; kept by each thread.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `source` with the tensors it makes as they are read (`Tensors::made_afresh`: weights
/// converted or quantized as they load) made here and held only as long as this is: a weight
/// is made from it and uploaded, and the source never holds a converted copy.
pub(crate) struct MadeAfresh<'s> {
    source: &'s dyn Tensors,
    made: quant::tensor::MemoryTensors,
}

impl<'s> MadeAfresh<'s> {
    /// `names`' tensors made afresh where `source` makes them so.
    pub(crate) fn of<'n>(source: &'s dyn Tensors, names: impl IntoIterator<Item = &'n str>) -> Self {
        let made = names
            .into_iter()
            .filter_map(|name| source.made_afresh(name).map(|t| (name.to_string(), t)))
            .collect();
        Self { source, made }
    }
}

impl Tensors for MadeAfresh<'_> {
    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        match self.made.get(name) {
            Some(t) => Some(TensorView {
                shape: &t.shape,
                dtype: t.dtype,
                bytes: &t.bytes,
            }),
            None => self.source.tensor(name),
        }
    }
}

/// One part as read: its tensor, the rows it takes, how the plan holds them, and its rows'
/// geometry.
struct PartView<'s> {
    view: TensorView<'s>,
    rows: Vec<Range<usize>>,
    encoding: Encoding,
    /// Source bytes and elements of a row.
    row_bytes: usize,
    row_elements: usize,
    /// The source elements in the part's order, where it transposes row groups.
    transposed: Option<Vec<usize>>,
}

/// How the plan's dtype stores a source tensor: converted to f32, bf16 or f16 (element
/// widths), or kept as stored.
#[derive(Clone, Copy, PartialEq)]
enum Encoding {
    F32,
    Bf16,
    F16,
    Stored,
}

impl Encoding {
    fn of(plan: DType, stored: GgmlType, name: &str) -> Result<Self> {
        match plan {
            DType::F32 if stored == GgmlType::F32 => Ok(Self::Stored),
            DType::F32 => Ok(Self::F32),
            DType::BF16 if stored == GgmlType::BF16 => Ok(Self::Stored),
            DType::BF16 => Ok(Self::Bf16),
            _ if quant::tensor::ir_dtype(stored) == plan => Ok(Self::Stored),
            DType::F16 => Ok(Self::F16),
            other => Err(RuntimeError::Weight(format!(
                "`{name}` is {} but the plan wants {other}",
                stored.name()
            ))),
        }
    }
}

impl<'s> PartView<'s> {
    /// Output bytes of a source row.
    fn out_row_bytes(&self) -> usize {
        match self.encoding {
            Encoding::F32 => self.row_elements * 4,
            Encoding::Bf16 | Encoding::F16 => self.row_elements * 2,
            Encoding::Stored => self.row_bytes,
        }
    }

    /// The source bytes of `rows`.
    fn bytes(&self, rows: &Range<usize>) -> &'s [u8] {
        &self.view.bytes[rows.start * self.row_bytes..rows.end * self.row_bytes]
    }
}

/// The bytes of a weight made of `parts` as a plan of `dtype` holds it (see the module's
/// doc): borrowed from `source` where they lie there already.
pub(crate) fn weight_bytes<'s>(dtype: DType, parts: &[WeightPart], source: &'s dyn Tensors) -> Result<Cow<'s, [u8]>> {
    let views = parts
        .iter()
        .map(|part| part_view(part, dtype, source))
        .collect::<Result<Vec<_>>>()?;
    if let [view] = views.as_slice() {
        if let (Encoding::Stored, [rows], None) = (view.encoding, view.rows.as_slice(), &view.transposed) {
            return Ok(Cow::Borrowed(view.bytes(rows)));
        }
    }
    let total: usize = views
        .iter()
        .map(|v| v.rows.iter().map(|r| r.len()).sum::<usize>() * v.out_row_bytes())
        .sum();
    let mut out = vec![0u8; total];
    let mut rest = out.as_mut_slice();
    for (part, view) in parts.iter().zip(&views) {
        if let Some(order) = &view.transposed {
            let len = order.len() * view.out_row_bytes() / view.row_elements.max(1);
            let (here, after) = rest.split_at_mut(len);
            transposed(view, order, here, part)?;
            rest = after;
            continue;
        }
        for rows in &view.rows {
            let (here, after) = rest.split_at_mut(rows.len() * view.out_row_bytes());
            convert_rows(view, view.bytes(rows), here);
            rest = after;
        }
    }
    Ok(Cow::Owned(out))
}

/// A run of a part's rows that goes to the device as stored: converted there to the plan's
/// dtype, or copied into place where the plan keeps it as stored.
pub(crate) struct StoredRun<'s> {
    /// The rows' stored bytes.
    pub bytes: &'s [u8],
    /// How they are stored.
    pub stored: DType,
    /// Whether the device converts them (else they are the plan's already).
    pub converted: bool,
    pub rows: usize,
    /// Stored bytes and elements of a row.
    pub row_bytes: usize,
    pub row_elements: usize,
}

/// The rows of a weight made of `parts` as runs of stored bytes, where the device can make the
/// plan's weight from them: no part transposes row groups, the device converts the stored
/// dtype of every part that needs converting (`converts`), and there is something to do
/// (a conversion, or several runs to stack: copies into place on the device, where the host
/// would first write the stacked weight into fresh memory). `None` where the host makes it
/// ([`weight_bytes`]): one run already in the plan's form (uploaded from the source as it
/// lies), or something the device cannot do.
pub(crate) fn stored_runs<'s>(
    dtype: DType,
    parts: &[WeightPart],
    source: &'s dyn Tensors,
    converts: &dyn Fn(DType) -> bool,
) -> Result<Option<Vec<StoredRun<'s>>>> {
    let mut runs = Vec::new();
    for part in parts {
        let view = part_view(part, dtype, source)?;
        let stored = quant::tensor::ir_dtype(view.view.dtype);
        let converted = view.encoding != Encoding::Stored;
        if view.transposed.is_some() || (converted && !converts(stored)) {
            return Ok(None);
        }
        runs.extend(view.rows.iter().map(|rows| StoredRun {
            bytes: view.bytes(rows),
            stored,
            converted,
            rows: rows.len(),
            row_bytes: view.row_bytes,
            row_elements: view.row_elements,
        }));
    }
    Ok((runs.len() > 1 || runs.iter().any(|r| r.converted)).then_some(runs))
}

fn part_view<'s>(part: &WeightPart, dtype: DType, source: &'s dyn Tensors) -> Result<PartView<'s>> {
    let name = part.name();
    let view = source
        .tensor(name)
        .ok_or_else(|| RuntimeError::Weight(format!("`{name}` is not in the weights")))?;
    let rows = view.shape.first().copied().unwrap_or(1).max(1);
    let selected = part.rows(rows);
    if selected.last().is_some_and(|r| r.end > rows) {
        return Err(RuntimeError::Weight(format!("{part}: `{name}` has {rows} rows")));
    }
    let row_elements = view.elements() / rows;
    Ok(PartView {
        encoding: Encoding::of(dtype, view.dtype, name)?,
        rows: selected,
        row_bytes: view.bytes.len() / rows,
        row_elements,
        transposed: part.transposed_elements(rows, row_elements),
        view,
    })
}

/// Source rows `from` (whole rows of `part`'s tensor) into `out`, encoded, a chunk of rows a
/// task.
fn convert_rows(part: &PartView<'_>, from: &[u8], out: &mut [u8]) {
    let (encoding, out_row) = (part.encoding, part.out_row_bytes());
    let rows_per_chunk = (CHUNK_BYTES / out_row.max(1)).max(1);
    out.par_chunks_mut(rows_per_chunk * out_row)
        .zip(from.par_chunks(rows_per_chunk * part.row_bytes))
        .for_each(|(out, from)| match encoding {
            Encoding::Stored => out.copy_from_slice(from),
            Encoding::F32 | Encoding::Bf16 | Encoding::F16 => SCRATCH.with_borrow_mut(|values| {
                values.resize(out.len() / out_row * part.row_elements, 0.0);
                part.view.dtype.dequantize(from, values);
                encode(values, encoding, out);
            }),
        });
}

/// f32 `values` into `out` as `encoding` (f32, bf16 or f16) stores them.
fn encode(values: &[f32], encoding: Encoding, out: &mut [u8]) {
    match encoding {
        Encoding::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(values) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        Encoding::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(values) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        _ => {
            for (o, v) in out.chunks_exact_mut(2).zip(values) {
                o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
    }
}

/// A part that transposes row groups: its elements in `order`, into `out`. Small (GLM-5's
/// `W_UK`), so on one thread, from the whole tensor's values.
fn transposed(part: &PartView<'_>, order: &[usize], out: &mut [u8], which: &WeightPart) -> Result<()> {
    match (part.encoding, part.view.dtype) {
        (Encoding::Stored, GgmlType::F16 | GgmlType::BF16 | GgmlType::F32) => {
            let width = part.row_bytes / part.row_elements.max(1);
            for (o, &i) in out.chunks_exact_mut(width).zip(order) {
                o.copy_from_slice(&part.view.bytes[i * width..(i + 1) * width]);
            }
            Ok(())
        }
        (Encoding::Stored, stored) => Err(RuntimeError::Weight(format!(
            "{which}: GGUF blocks do not transpose (`{}` is {})",
            which.name(),
            stored.name()
        ))),
        _ => {
            let values = part.view.to_f32().data;
            let picked: Vec<f32> = order.iter().map(|&i| values[i]).collect();
            encode(&picked, part.encoding, out);
            Ok(())
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use gpu_plan::Transposed;
    use proptest::prelude::*;
    use quant::tensor::{MemoryTensor, MemoryTensors};

    /// The definition the fast paths must meet, element by element: every source element in
    /// the part's order (its rows, or its transposed row groups), decoded to f32 and encoded
    /// as the plan's dtype; or, kept as stored, the bytes of its rows.
    fn reference(dtype: DType, parts: &[WeightPart], source: &MemoryTensors) -> Vec<u8> {
        let mut out = Vec::new();
        for part in parts {
            let t = &source[part.name()];
            let view = source.tensor(part.name()).unwrap();
            let rows = t.shape[0];
            let cols = view.elements() / rows;
            let order: Vec<usize> = part.transposed_elements(rows, cols).unwrap_or_else(|| {
                part.rows(rows)
                    .into_iter()
                    .flat_map(|r| r.start * cols..r.end * cols)
                    .collect()
            });
            let stored = quant::tensor::ir_dtype(t.dtype) == dtype;
            if stored && !matches!(t.dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                let row_bytes = t.bytes.len() / rows;
                for r in part.rows(rows) {
                    out.extend_from_slice(&t.bytes[r.start * row_bytes..r.end * row_bytes]);
                }
                continue;
            }
            let width = t.bytes.len() / view.elements();
            if stored {
                for i in order {
                    out.extend_from_slice(&t.bytes[i * width..(i + 1) * width]);
                }
                continue;
            }
            let values = view.to_f32().data;
            for i in order {
                match dtype {
                    DType::F32 => out.extend_from_slice(&values[i].to_le_bytes()),
                    DType::F16 => out.extend_from_slice(&half::f16::from_f32(values[i]).to_le_bytes()),
                    _ => out.extend_from_slice(&bf16::from_f32(values[i]).to_le_bytes()),
                }
            }
        }
        out
    }

    /// `n` values spread over ±2, from `seed`.
    pub(in crate::plan_exec) fn spread_values(seed: u32, n: usize) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    /// A `rows` × `cols` tensor of `dtype` from `values` (NaN and signed zeros among them
    /// where it stores floats): Q4_0 blocks quantized from them, Q8_0 blocks a half scale
    /// and 32 signed bytes from the values' bits (any will do).
    pub(in crate::plan_exec) fn tensor(dtype: GgmlType, rows: usize, cols: usize, values: &[f32]) -> MemoryTensor {
        let bytes = match dtype {
            GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            GgmlType::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            GgmlType::BF16 => values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
            GgmlType::Q8_0 => values
                .chunks(32)
                .flat_map(|block| {
                    let scale = half::f16::from_f32(block[0] / 64.0).to_le_bytes();
                    scale.into_iter().chain(block.iter().map(|v| v.to_bits() as u8))
                })
                .collect(),
            _ => values.chunks(cols).flat_map(quant::q4_0::quantize_row).collect(),
        };
        MemoryTensor {
            shape: vec![rows, cols],
            dtype,
            bytes,
        }
    }

    fn part(name: &str, shape: usize, group: usize, start: usize, len: usize) -> WeightPart {
        match shape {
            0 => WeightPart::Whole(name.into()),
            1 => WeightPart::RowGroups {
                name: name.into(),
                group,
                start,
                len,
            },
            _ => WeightPart::TransposedRowGroups {
                name: name.into(),
                group,
                start,
                len,
                transposed: Transposed::YES,
            },
        }
    }

    proptest! {
        /// Every source dtype into every plan dtype it converts to, whole or by row groups
        /// (transposed where the source holds floats), two parts stacked, rows enough for
        /// several tasks: the bytes the definition gives.
        #[test]
        fn weight_bytes_are_the_definitions(
            source in prop::sample::select(vec![GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0]),
            plan in prop::sample::select(vec![DType::F32, DType::BF16, DType::F16, DType::Q4_0]),
            shapes in (0usize..3, 0usize..3),
            groups in 1usize..4,
            tall in any::<bool>(),
            seed in any::<u32>(),
        ) {
            let stored = quant::tensor::ir_dtype(source);
            prop_assume!(matches!(plan, DType::F32 | DType::BF16 | DType::F16) || plan == stored);
            let blocks = !matches!(source, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
            let (group, cols) = (4, 64);
            // Tall enough for several tasks of CHUNK_BYTES.
            let rows = group * groups * if tall { 600 } else { 1 };
            let mut values = spread_values(seed, rows * cols);
            if !blocks {
                values[1] = f32::NAN;
                values[2] = -0.0;
            }
            let source_tensors: MemoryTensors = ["a", "b"]
                .into_iter()
                .map(|name| (name.to_string(), tensor(source, rows, cols, &values)))
                .collect();
            let transposes = |s: usize| if blocks && plan == stored { s.min(1) } else { s };
            let parts = [
                part("a", transposes(shapes.0), group, 1, 2),
                part("b", transposes(shapes.1), group, 0, 3),
            ];
            let got = weight_bytes(plan, &parts, &source_tensors).unwrap();
            prop_assert!(got.as_ref() == reference(plan, &parts, &source_tensors).as_slice());
        }
    }

    /// A whole tensor already in the plan's form is the source's bytes themselves, not a
    /// copy: what goes straight to the device.
    #[test]
    fn a_tensor_in_the_plans_form_is_not_copied() {
        let values: Vec<f32> = (0..256).map(|i| i as f32).collect();
        for (stored, plan) in [
            (GgmlType::BF16, DType::BF16),
            (GgmlType::F32, DType::F32),
            (GgmlType::Q4_0, DType::Q4_0),
        ] {
            let source: MemoryTensors = [("w".to_string(), tensor(stored, 4, 64, &values))].into();
            let got = weight_bytes(plan, &[WeightPart::Whole("w".into())], &source).unwrap();
            match got {
                Cow::Borrowed(bytes) => assert_eq!(bytes.as_ptr(), source["w"].bytes.as_ptr()),
                Cow::Owned(_) => panic!("{stored:?} into {plan} was copied"),
            }
        }
    }

    #[test]
    fn what_cannot_be_made_is_refused_by_name() {
        let values = vec![0.5f32; 256];
        let source: MemoryTensors = [
            ("w".to_string(), tensor(GgmlType::BF16, 4, 64, &values)),
            ("q".to_string(), tensor(GgmlType::Q4_0, 4, 64, &values)),
        ]
        .into();
        let error = |dtype, part: WeightPart| weight_bytes(dtype, &[part], &source).unwrap_err().to_string();
        assert!(error(DType::BF16, WeightPart::Whole("x".into())).contains("`x` is not in the weights"));
        // Blocks are never made from floats.
        assert!(error(DType::Q4_0, WeightPart::Whole("w".into())).contains("the plan wants q4_0"));
        assert!(error(DType::BF16, part("w", 1, 2, 3, 2)).contains("has 4 rows"));
        assert!(error(DType::Q4_0, part("q", 2, 2, 0, 1)).contains("GGUF blocks do not transpose"));
    }
}
