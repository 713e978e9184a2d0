//! Tensor-core kernels over IEEE halves: a kernel written for bf16 operands (the TMA GEMMs, the
//! MoE experts' tiles) retyped so that half weights are multiplied as stored. bf16 and f16 are
//! both 16 bits, so every copy, tensor map, swizzle and fragment layout stays as it is; only
//! the instructions' element type and the conversions at the edges (f32 to a stored half,
//! registers packed as operands) change.

use crate::dsl::*;

/// `kernel`, of bf16 operands, as `name` over IEEE halves: its bf16 buffers (activation rows,
/// weights, intermediate rows it hands on) f16, their tensor maps too, its shared tiles f16,
/// its MMAs of halves, its description naming f16 where it named bf16. Weights stored as halves
/// are multiplied exactly; activations round to half instead of bf16, as the launch making its
/// rows does.
pub fn over_halves(mut kernel: Kernel, name: &str) -> Kernel {
    for p in &mut kernel.params {
        if let Param::Buffer { ty: ty @ Ty::Bf16, .. } = p {
            *ty = Ty::F16;
        }
    }
    for array in &mut kernel.shared {
        if array.ty == Ty::Bf16 {
            array.ty = Ty::F16;
        }
    }
    edit_stmts(&mut kernel.body, &mut |s| {
        if let Stmt::Mma(m) = s {
            m.element = MmaElement::F16;
        }
    });
    kernel.name = name.into();
    // The description names the types the kernel now takes.
    kernel.origin = format!(
        "{}, over halves",
        kernel.origin.replace("bf16", "f16").replace("Bf16", "F16")
    );
    kernel
}

/// `kernel`, of bf16 operands, multiplying `element`s: as it is for bf16, over halves for f16
/// (its name then ending `_f16`).
pub fn multiplying(element: MmaElement, kernel: Kernel) -> Kernel {
    match element {
        MmaElement::Bf16 => kernel,
        MmaElement::F16 => {
            let name = format!("{}_f16", kernel.name);
            over_halves(kernel, &name)
        }
    }
}
