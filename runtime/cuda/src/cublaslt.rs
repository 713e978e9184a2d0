//! cuBLASLt's bf16 GEMM on the device's stream: the yardstick `bbc gpu-check` times bbc's
//! generated GEMMs against, never what serves. Loaded at run time from the machine's CUDA
//! libraries (`BBC_CUBLASLT_DIR`, `CUDA_HOME`/`CUDA_PATH`, `/usr/local/cuda`, or the loader's
//! path, where PyTorch's wheels put it); its absence is an error, not a panic.
//!
//! `out[t, r] = Σ_k x[t, k]·W[r, k]` as PyTorch's `linear` asks it: bf16 operands and result,
//! f32 accumulation, the algorithm cuBLASLt's heuristic ranks first for the shape, chosen once.

use crate::CudaDevice;
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use runtime::{Result, RuntimeError};
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;

/// The soname CUDA 13 installs.
const LIBRARY: &str = "libcublasLt.so.13";
/// Workspace cuBLASLt may use: NVIDIA's recommendation for Hopper and newer.
const WORKSPACE_BYTES: usize = 32 << 20;

fn failed(what: &str, e: impl std::fmt::Debug) -> RuntimeError {
    RuntimeError::Cuda(format!("cuBLASLt {what}: {e:?}"))
}

/// Where cuBLASLt may be, in order, when the loader does not find it by itself.
fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("BBC_CUBLASLT_DIR")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    let toolkits = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .chain([PathBuf::from("/usr/local/cuda")]);
    dirs.extend(toolkits.map(|t| t.join("lib64")));
    dirs
}

/// Load cuBLASLt, or say where it was looked for.
fn ensure_loaded() -> Result<()> {
    // SAFETY: probing for the library has no side effect beyond loading it.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    let dirs = candidate_dirs();
    let Some(path) = dirs.iter().map(|d| d.join(LIBRARY)).find(|p| p.is_file()) else {
        let searched: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        return Err(RuntimeError::Cuda(format!(
            "{LIBRARY} is on neither the loader path nor in {}; point BBC_CUBLASLT_DIR at the directory holding it",
            searched.join(", ")
        )));
    };
    // SAFETY: loading the library runs its initialisers, as any use of it would.
    let library = unsafe { libloading::Library::new(&path) }.map_err(|e| failed("load", e))?;
    // Kept for the process: cudarc resolves its symbols by name from now on.
    std::mem::forget(library);
    // SAFETY: as above.
    match unsafe { sys::is_culib_present() } {
        true => Ok(()),
        false => Err(RuntimeError::Cuda(format!("{} loaded but not visible", path.display()))),
    }
}

/// A cuBLASLt handle and workspace on a device's stream.
pub struct CublasLt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
}

impl Drop for CublasLt {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

/// One GEMM shape with the algorithm cuBLASLt chose for it.
pub struct CublasGemm {
    desc: sys::cublasLtMatmulDesc_t,
    /// W (stored k×n, column-major: transposed), x (k×tokens), out (n×tokens).
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for CublasGemm {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created for this GEMM and is destroyed once.
        unsafe {
            let _ = result::destroy_matmul_desc(self.desc);
            for layout in self.layouts {
                let _ = result::destroy_matrix_layout(layout);
            }
        }
    }
}

impl CudaDevice {
    /// cuBLASLt on this device's stream.
    pub fn cublaslt(&self) -> Result<CublasLt> {
        ensure_loaded()?;
        let workspace = self.stream.alloc_zeros::<u8>(WORKSPACE_BYTES).map_err(crate::driver)?;
        let handle = result::create_handle().map_err(|e| failed("create", e))?;
        Ok(CublasLt {
            handle,
            workspace,
            stream: self.stream.clone(),
        })
    }
}

impl CublasLt {
    /// The GEMM of `tokens` rows of x (`x_stride` elements apart) by the `n`×`k` weights.
    pub fn plan(&self, tokens: usize, n: usize, k: usize, x_stride: usize) -> Result<CublasGemm> {
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let layout = |rows: usize, cols: usize, ld: usize| {
            result::create_matrix_layout(bf16, rows as u64, cols as u64, ld as i64).map_err(|e| failed("layout", e))
        };
        // Column-major: out (n × tokens) = Wᵀ-stored (k × n, transposed) · x (k × tokens).
        let layouts = [layout(k, n, k)?, layout(k, tokens, x_stride)?, layout(n, tokens, n)?];
        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(|e| failed("descriptor", e))?;
        let mut gemm = CublasGemm {
            desc,
            layouts,
            algo: unsafe { std::mem::zeroed() },
        };
        let transpose: i32 = 1;
        let workspace = WORKSPACE_BYTES as u64;
        // SAFETY: the descriptors are live; the attribute values are of the sizes given.
        unsafe {
            result::set_matmul_desc_attribute(
                gemm.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transpose as *const i32).cast(),
                std::mem::size_of::<i32>(),
            )
            .map_err(|e| failed("transpose", e))?;
            let preference = result::create_matmul_pref().map_err(|e| failed("preference", e))?;
            let chosen = result::set_matmul_pref_attribute(
                preference,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
            .and_then(|()| {
                result::get_matmul_algo_heuristic(
                    self.handle,
                    gemm.desc,
                    gemm.layouts[0],
                    gemm.layouts[1],
                    gemm.layouts[2],
                    gemm.layouts[2],
                    preference,
                )
            });
            let _ = result::destroy_matmul_pref(preference);
            gemm.algo = chosen
                .map_err(|e| failed(&format!("heuristic for {tokens}×{n}×{k}"), e))?
                .algo;
        }
        Ok(gemm)
    }

    /// Run `gemm` on the stream: `out` (bf16, tokens × n) from `x` and `w` (bf16).
    pub fn run(&self, gemm: &CublasGemm, x: &CudaSlice<u8>, w: &CudaSlice<u8>, out: &CudaSlice<u8>) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        let (x, _x) = x.device_ptr(&self.stream);
        let (w, _w) = w.device_ptr(&self.stream);
        let (out, _out) = out.device_ptr(&self.stream);
        let (workspace, _workspace) = self.workspace.device_ptr(&self.stream);
        // SAFETY: the descriptors are live and describe buffers the caller sized for the plan's
        // shape; the workspace is the size the algorithm was chosen for.
        unsafe {
            result::matmul(
                self.handle,
                gemm.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w as *const c_void,
                gemm.layouts[0],
                x as *const c_void,
                gemm.layouts[1],
                out as *const c_void,
                gemm.layouts[2],
                out as *mut c_void,
                gemm.layouts[2],
                &gemm.algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| failed("matmul", e))
    }
}
