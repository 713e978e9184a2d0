//! A kernel's parameters as a launch fills them: the launch arguments in order, and the tensor
//! maps (`kernels_gen::dsl::TensorMap`) the launcher derives from them, encoded by the driver
//! (`cuTensorMapEncodeTiled`) from the map's buffer argument and its sizes evaluated from the
//! scalar arguments.

use cudarc::driver::sys;
use kernels_gen::dsl::{Kernel, MmaElement, Param, Swizzle, TensorMap};
use runtime::plan_exec::DeviceArg;
use runtime::{Result, RuntimeError};

/// What fills one kernel parameter.
#[derive(Debug, Clone, PartialEq)]
enum Slot {
    /// Launch argument `i`.
    Argument(usize),
    /// Tensor map `i` of [`KernelParams::maps`].
    Map(usize),
}

/// A kernel's parameters: what fills each, in order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct KernelParams {
    slots: Vec<Slot>,
    /// The launch parameters' names, in order (the scalars a map's sizes name).
    names: Vec<String>,
    /// Each map with the launch argument of its buffer, and that buffer's elements.
    maps: Vec<(TensorMap, usize, MmaElement)>,
}

impl KernelParams {
    pub(crate) fn of(kernel: &Kernel) -> Result<Self> {
        let names: Vec<String> = kernel.launch_params().map(|p| p.name().to_string()).collect();
        let (mut slots, mut maps) = (Vec::new(), Vec::new());
        for p in &kernel.params {
            match p {
                Param::TensorMap(map) => {
                    let buffer = names.iter().position(|n| *n == map.buffer);
                    let element = match kernel.param(&map.buffer) {
                        Some(Param::Buffer { ty, .. }) => MmaElement::of(*ty),
                        _ => None,
                    };
                    let (Some(buffer), Some(element)) = (buffer, element) else {
                        return Err(RuntimeError::Artifact(format!(
                            "{}: tensor map `{}` over no bf16 or f16 buffer",
                            kernel.name, map.name
                        )));
                    };
                    slots.push(Slot::Map(maps.len()));
                    maps.push(((**map).clone(), buffer, element));
                }
                _ => slots.push(Slot::Argument(slots.len() - maps.len())),
            }
        }
        Ok(Self { slots, names, maps })
    }

    /// From a plan's entry (its launch parameters, then its tensor maps).
    pub(crate) fn of_entry(entry: &gpu_plan::KernelEntry) -> Result<Self> {
        let names: Vec<String> = entry.params.iter().map(|p| p.name.clone()).collect();
        let mut slots: Vec<Slot> = (0..names.len()).map(Slot::Argument).collect();
        let mut maps = Vec::new();
        for map in &entry.tensor_maps {
            let buffer = names.iter().position(|n| *n == map.buffer).ok_or_else(|| {
                RuntimeError::Artifact(format!("{}: tensor map `{}` over no buffer", entry.name, map.name))
            })?;
            let element = map_entry_element(map).ok_or_else(|| {
                RuntimeError::Artifact(format!(
                    "{}: tensor map `{}` of `{}` elements (bf16 or f16)",
                    entry.name, map.name, map.element
                ))
            })?;
            let var = |name: &str| kernels_gen::dsl::Expr::Var(name.to_string());
            let map = TensorMap {
                name: map.name.clone(),
                buffer: map.buffer.clone(),
                rows: var(&map.rows),
                cols: var(&map.cols),
                stride: var(&map.stride),
                box_rows: map.box_rows,
                box_cols: map.box_cols,
                swizzle: if map.swizzle_128b { Swizzle::B128 } else { Swizzle::None },
            };
            slots.push(Slot::Map(maps.len()));
            maps.push((map, buffer, element));
        }
        Ok(Self { slots, names, maps })
    }

    /// How many arguments a launch gives.
    pub(crate) fn arguments(&self) -> usize {
        self.slots.len() - self.maps.len()
    }

    /// The driver's arguments for each tensor map of a launch with `args`, whose buffers lie at
    /// `address(i)` (argument i's device address).
    pub(crate) fn encodings<B>(
        &self,
        args: &[DeviceArg<'_, B>],
        address: impl Fn(usize) -> u64,
    ) -> Result<Vec<(Encoding, u64)>> {
        let scalar = |name: &str| {
            let at = self.names.iter().position(|n| n == name)?;
            match args.get(at)? {
                DeviceArg::I32(v) => Some(*v as i64),
                _ => None,
            }
        };
        self.maps
            .iter()
            .map(|(map, buffer, element)| Ok((encoding(map, *element, &scalar)?, address(*buffer))))
            .collect()
    }

    /// The parameter pointers of a launch: `arguments[i]` for launch argument i, `maps[j]`
    /// for tensor map j.
    pub(crate) fn pointers(&self, arguments: &mut [u64], maps: &mut [sys::CUtensorMap]) -> Vec<*mut std::ffi::c_void> {
        let (arguments, maps) = (arguments.as_mut_ptr(), maps.as_mut_ptr());
        self.slots
            .iter()
            .map(|slot| match *slot {
                // SAFETY (of the offsets): slots index inside both slices, built from the
                // same parameters.
                Slot::Argument(i) => unsafe { arguments.add(i) }.cast(),
                Slot::Map(j) => unsafe { maps.add(j) }.cast(),
            })
            .collect()
    }
}

/// `cuTensorMapEncodeTiled`'s arguments for a 2-D map of 16-bit floats (innermost dimension
/// first).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Encoding {
    pub element: MmaElement,
    pub dims: [u64; 2],
    /// Bytes between rows (the outer dimension's stride; the inner one is the element).
    pub row_pitch: u64,
    pub box_dims: [u32; 2],
    pub swizzle: Swizzle,
}

/// The element type a plan's map entry names.
fn map_entry_element(entry: &gpu_plan::TensorMapEntry) -> Option<MmaElement> {
    match entry.element.as_str() {
        "bf16" => Some(MmaElement::Bf16),
        "f16" => Some(MmaElement::F16),
        _ => None,
    }
}

/// The encoding of `map` (of `element`s) with its sizes evaluated from the launch's scalars, or why the
/// driver would refuse it.
pub(crate) fn encoding(map: &TensorMap, element: MmaElement, scalar: &dyn Fn(&str) -> Option<i64>) -> Result<Encoding> {
    let (rows, cols, stride) = map.sizes(scalar).map_err(RuntimeError::Artifact)?;
    Ok(Encoding {
        element,
        dims: [cols as u64, rows as u64],
        row_pitch: 2 * stride as u64,
        box_dims: [map.box_cols, map.box_rows],
        swizzle: map.swizzle,
    })
}

/// The driver's tensor map for `encoding` over the tensor at device address `address`
/// (16-byte aligned); elements outside the tensor read as zeros.
pub(crate) fn encode(encoding: &Encoding, address: u64) -> Result<sys::CUtensorMap> {
    if !address.is_multiple_of(16) {
        return Err(RuntimeError::Cuda(format!(
            "a tensor map over {address:#x}, not 16-byte aligned"
        )));
    }
    let swizzle = match encoding.swizzle {
        Swizzle::None => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        Swizzle::B128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    };
    let data_type = match encoding.element {
        MmaElement::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        MmaElement::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    let strides = [encoding.row_pitch];
    let element_strides = [1u32, 1];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer addresses a live array of the rank's length (rank 2: two dims, box
    // sides and element strides, one stride); the driver writes the 128-byte map only.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            2,
            address as *mut std::ffi::c_void,
            encoding.dims.as_ptr(),
            strides.as_ptr(),
            encoding.box_dims.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(|e| RuntimeError::Cuda(format!("cuTensorMapEncodeTiled: {e:?}")))?;
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels_gen::templates::gemm_tma_wgmma::{gemm_tma_wgmma_bf16, TmaTile};

    /// A plan's entry of a kernel says what the kernel itself says: its arguments, its maps
    /// after them, over the same buffers of the same elements, sized by the same scalars; for
    /// every TMA GEMM, the TMA-fed attention over a half cache (whose maps are f16) and a
    /// kernel without maps. An entry naming elements a map cannot have is refused.
    #[test]
    fn a_plan_entry_gives_the_kernels_own_parameters() {
        use kernels_gen::dsl::Ty;
        use kernels_gen::templates::cache_layout::CacheLayout;
        use kernels_gen::templates::flash_attention_wgmma::{flash_attention_wgmma_over, Schedule};
        use kernels_gen::templates::{gemm_tma_mma, gemm_tma_tcgen05};
        let half_attention =
            flash_attention_wgmma_over("flash", "test", CacheLayout::Batched, (128, Ty::F16), Schedule::Tma);
        let kernels = [
            gemm_tma_wgmma_bf16("gemm", "test", TmaTile::WIDEST),
            gemm_tma_tcgen05::gemm_tma_tcgen05_bf16("gemm", "test", gemm_tma_tcgen05::TcgenTile::WIDE),
            gemm_tma_mma::gemm_tma_mma_bf16("gemm", "test"),
            half_attention.clone(),
            kernels_gen::templates::fill::fill_kernels().remove(0),
        ];
        for kernel in kernels {
            let entry = codegen::gpu::kernel_entry(&kernel);
            assert_eq!(
                KernelParams::of_entry(&entry).unwrap(),
                KernelParams::of(&kernel).unwrap()
            );
        }
        let mut entry = codegen::gpu::kernel_entry(&half_attention);
        let elements: Vec<_> = KernelParams::of_entry(&entry)
            .unwrap()
            .maps
            .into_iter()
            .map(|m| m.2)
            .collect();
        assert_eq!(elements, [MmaElement::F16; 2]);
        entry.tensor_maps[0].element = "f32".into();
        let message = KernelParams::of_entry(&entry).unwrap_err().to_string();
        assert!(message.contains("tensor map `k_map` of `f32` elements"), "{message}");
    }

    #[test]
    fn the_tma_gemm_takes_its_maps_after_its_arguments_from_their_buffers() {
        let kernel = gemm_tma_wgmma_bf16("gemm", "test", TmaTile::WIDE);
        let params = KernelParams::of(&kernel).unwrap();
        let names: Vec<&str> = params.names.iter().map(String::as_str).collect();
        assert_eq!(
            names,
            ["x", "w", "out", "tokens", "n", "k", "x_stride", "partial", "splits"]
        );
        assert_eq!(params.arguments(), 9);
        let buffers: Vec<usize> = params.maps.iter().map(|(_, b, _)| *b).collect();
        assert_eq!(buffers, [0, 1]);
        assert_eq!(params.slots[9..], [Slot::Map(0), Slot::Map(1)]);
        // tokens 20, n 300, k 136, rows of x `x_stride` apart.
        let args = |x_stride: i32| -> Vec<DeviceArg<'static, ()>> {
            vec![
                DeviceArg::Buffer(&(), 0..1),
                DeviceArg::Buffer(&(), 0..1),
                DeviceArg::Buffer(&(), 0..1),
                DeviceArg::I32(20),
                DeviceArg::I32(300),
                DeviceArg::I32(136),
                DeviceArg::I32(x_stride),
                DeviceArg::Buffer(&(), 0..1),
                DeviceArg::I32(1),
            ]
        };
        let maps = params.encodings(&args(144), |i| 0x1000 * (i as u64 + 1)).unwrap();
        let x = Encoding {
            element: MmaElement::Bf16,
            dims: [136, 20],
            row_pitch: 288,
            box_dims: [64, 128],
            swizzle: Swizzle::B128,
        };
        let w = Encoding {
            element: MmaElement::Bf16,
            dims: [136, 300],
            row_pitch: 272,
            box_dims: [64, 128],
            swizzle: Swizzle::B128,
        };
        assert_eq!(maps, [(x, 0x1000), (w, 0x2000)]);
        // A pitch TMA cannot take is refused before the driver sees it.
        let message = params.encodings(&args(140), |_| 0).unwrap_err().to_string();
        assert!(message.contains("280 bytes apart"), "{message}");
        let mut pointers_args = [0u64; 9];
        let mut map_storage = [sys::CUtensorMap { opaque: [0; 16] }; 2];
        let pointers = params.pointers(&mut pointers_args, &mut map_storage);
        assert_eq!(pointers.len(), 11);
        assert_eq!(pointers[10], (&mut map_storage[1] as *mut sys::CUtensorMap).cast());
    }
}
