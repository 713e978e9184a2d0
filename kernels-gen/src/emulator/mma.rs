//! The warp-wide tensor-core statements of `mma.sync` kernels: `mma.sync` itself and
//! `ldmatrix`, which loads its operands. Both gather from and scatter to the lanes in the PTX
//! ISA's register layouts (see `Stmt::Mma` and `LoadMatrix`).

use super::{vector_aligned, Array, Block, Fault, Val};
use crate::dsl::*;
use half::{bf16, f16};
use std::collections::HashMap;
use std::ops::Range;

/// The lanes of each warp `mask` runs: every one of them, or a fault naming `what`.
fn whole_warps(mask: &[bool], what: &str) -> Result<Vec<Range<usize>>, Fault> {
    let mut warps = Vec::new();
    for warp_start in (0..mask.len()).step_by(32) {
        let lanes = warp_start..(warp_start + 32).min(mask.len());
        if !lanes.clone().any(|l| mask[l]) {
            continue;
        }
        if let Some(l) = lanes.clone().find(|&l| !mask[l]) {
            return Err((
                l,
                format!("{what} with an inactive lane: the whole warp must take part"),
            ));
        }
        if lanes.len() < 32 {
            return Err((warp_start, format!("{what} needs a full warp")));
        }
        warps.push(lanes);
    }
    Ok(warps)
}

impl Block<'_> {
    /// The element type of `name`, a shared array of tensor-core operands (type-checked).
    pub(super) fn element_of(&self, name: &str) -> MmaElement {
        MmaElement::of(self.shared[name].ty).expect("type-checked")
    }

    /// A fragment local's value on `lane`, which must be set.
    fn fragment(&self, name: &str, lane: usize) -> Result<Val, Fault> {
        match self.vars.get(name).map(|v| v[lane]) {
            Some(Val::Undef) | None => Err((lane, format!("mma fragment `{name}` is not set"))),
            Some(v) => Ok(v),
        }
    }

    /// Element `i` of `operand` (in `Stmt::Mma`'s order) on `lane`, as an MMA of `element`s
    /// takes it: rounded to that type, or its bits read as one.
    fn operand_element(
        &self,
        (operand, element): (&MmaOperand, MmaElement),
        i: usize,
        lane: usize,
    ) -> Result<f32, Fault> {
        Ok(match operand {
            MmaOperand::F32(names) => rounded(element, self.fragment(&names[i], lane)?.f()),
            MmaOperand::Pairs(names) => {
                let bits = self.fragment(&names[i / 2], lane)?.i() >> (16 * (i % 2));
                from_bits(element, bits as u16)
            }
        })
    }

    /// One m16n8k16 MMA per warp: gather the fragments from the lanes, multiply with 16-bit
    /// operands and f32 accumulation, scatter back.
    pub(super) fn mma_sync(&mut self, m: &MmaFragments, mask: &[bool]) -> Result<(), Fault> {
        for lanes in whole_warps(mask, "mma.sync")? {
            let (mut ma, mut mb, mut mc) = ([[0f32; 16]; 16], [[0f32; 8]; 16], [[0f32; 8]; 16]);
            for lane in 0..32 {
                let (g, t, l) = (lane / 4, lane % 4, lanes.start + lane);
                for i in 0..8 {
                    let row = g + if i % 4 >= 2 { 8 } else { 0 };
                    let col = 2 * t + (i % 2) + if i >= 4 { 8 } else { 0 };
                    ma[row][col] = self.operand_element((&m.a, m.element), i, l)?;
                }
                for i in 0..4 {
                    mb[2 * t + (i % 2) + if i >= 2 { 8 } else { 0 }][g] =
                        self.operand_element((&m.b, m.element), i, l)?;
                }
                for (i, name) in m.c.iter().enumerate() {
                    mc[g + if i >= 2 { 8 } else { 0 }][2 * t + (i % 2)] = self.fragment(name, l)?.f();
                }
            }
            for (row, acc) in mc.iter_mut().enumerate() {
                for (col, out) in acc.iter_mut().enumerate() {
                    *out += (0..16).map(|k| ma[row][k] * mb[k][col]).sum::<f32>();
                }
            }
            for lane in 0..32 {
                let (g, t, l) = (lane / 4, lane % 4, lanes.start + lane);
                for (i, name) in m.c.iter().enumerate() {
                    let v = mc[g + if i >= 2 { 8 } else { 0 }][2 * t + (i % 2)];
                    self.vars.get_mut(name).expect("type-checked")[l] = Val::F(v);
                }
            }
        }
        Ok(())
    }

    /// `ldmatrix`: each addressing lane's row read (through `Load`, which checks bounds,
    /// initialisation and shared-memory ordering), then every lane's pairs gathered from them.
    pub(super) fn load_matrix(
        &mut self,
        m: &LoadMatrix,
        mask: &[bool],
        global: &HashMap<String, Array>,
    ) -> Result<(), Fault> {
        let warps = whole_warps(mask, "ldmatrix")?;
        let matrices = m.names.len();
        let addressing: Vec<bool> = (0..mask.len()).map(|t| mask[t] && t % 32 < 8 * matrices).collect();
        let row = self.eval(&m.row, &addressing, global)?;
        vector_aligned(("ldmatrix row", &m.buf), &row, &addressing, 8, global)?;
        // A matrix a phase: 8 rows of 16 bytes, as a 16-byte load by 8 lanes.
        self.count_traffic(&m.buf, &row, &addressing, (2, 16));
        self.traffic_paused.set(true);
        let rows: Result<Vec<Vec<Val>>, Fault> = (0..8)
            .map(|j| {
                let element = Expr::Load {
                    buf: m.buf.clone(),
                    index: Box::new(m.row.clone() + int(j)),
                };
                self.eval(&element, &addressing, global)
            })
            .collect();
        self.traffic_paused.set(false);
        let rows = rows?;
        let element = self.element_of(&m.buf);
        let mut pairs = vec![vec![Val::Undef; mask.len()]; matrices];
        for lanes in warps {
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for (i, pair) in pairs.iter_mut().enumerate() {
                    // (row, column) of the pair's two elements in matrix i.
                    let [lo, hi] = match m.transpose {
                        false => [(g, 2 * t), (g, 2 * t + 1)],
                        true => [(2 * t, g), (2 * t + 1, g)],
                    };
                    let bits = |(r, c): (usize, usize)| to_bits(element, rows[c][lanes.start + 8 * i + r].f());
                    pair[lanes.start + lane] = Val::I(bits(lo) as i64 | (bits(hi) as i64) << 16);
                }
            }
        }
        for (name, values) in m.names.iter().zip(&pairs) {
            self.touch(name, mask)?;
            self.declare(name, Ty::U32, values, mask);
        }
        Ok(())
    }
}

/// `v` rounded (nearest even) to `element`, as a tensor-core multiply of them takes an f32.
pub(super) fn rounded(element: MmaElement, v: f32) -> f32 {
    match element {
        MmaElement::Bf16 => bf16::from_f32(v).to_f32(),
        MmaElement::F16 => f16::from_f32(v).to_f32(),
    }
}

/// The bits of `v` rounded to `element`.
fn to_bits(element: MmaElement, v: f32) -> u16 {
    match element {
        MmaElement::Bf16 => bf16::from_f32(v).to_bits(),
        MmaElement::F16 => f16::from_f32(v).to_bits(),
    }
}

/// The value of an `element` given as its bits.
fn from_bits(element: MmaElement, bits: u16) -> f32 {
    match element {
        MmaElement::Bf16 => bf16::from_bits(bits).to_f32(),
        MmaElement::F16 => f16::from_bits(bits).to_f32(),
    }
}
