//! The kernels' modules, loaded on a thread of their own while the weights upload: reading a
//! plan's cubins and loading each into the driver is a few hundred modules' work, which the
//! uploads need not wait for. A launch waits for its own kernel only; loading the plan waits
//! for them all (`PlanDevice::kernels_loaded`), so a module the driver refuses still fails
//! the load, not a later step.

use crate::{driver, tensor_map};
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;
use runtime::{Result, RuntimeError};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;

/// A kernel loaded from its module.
pub(crate) struct LoadedKernel {
    pub function: CudaFunction,
    /// What fills its parameters: a launch must give exactly its arguments (the driver would
    /// read whatever lies past the arguments given); tensor maps are derived from them.
    pub params: tensor_map::KernelParams,
    /// Bytes of dynamic shared memory it is launched with.
    pub shared_bytes: u32,
    /// Whether it waits for the kernel before it (`kernels_gen::cuda::awaits_prior_kernel`).
    pub awaits_prior_kernel: bool,
}

/// A kernel to load.
pub(crate) struct KernelImage {
    pub name: String,
    pub image: Image,
    pub params: tensor_map::KernelParams,
    pub awaits_prior_kernel: bool,
    pub shared_bytes: u32,
}

/// Where a kernel's machine code or PTX comes from.
pub(crate) enum Image {
    /// An artifact's cubin file.
    Cubin(PathBuf),
    /// An artifact's PTX file (where it has no cubin).
    Ptx(PathBuf),
    /// In memory already.
    Loaded(Ptx),
}

impl Image {
    fn read(self) -> Result<Ptx> {
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|e| RuntimeError::Artifact(format!("{}: {e}", path.display())))
        };
        Ok(match self {
            Self::Cubin(path) => Ptx::from_binary(read(&path)?),
            Self::Ptx(path) => {
                let text = String::from_utf8(read(&path)?)
                    .map_err(|e| RuntimeError::Artifact(format!("{}: {e}", path.display())))?;
                if text.contains('\0') {
                    return Err(RuntimeError::Artifact(format!("{}: not PTX text", path.display())));
                }
                Ptx::from_src(text)
            }
            Self::Loaded(ptx) => ptx,
        })
    }
}

/// The plan's kernels as their modules load.
pub(crate) type Kernels = Loading<LoadedKernel>;

impl Kernels {
    /// Start loading `images`, in order, into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>, images: Vec<KernelImage>) -> Result<Self> {
        let ctx = ctx.clone();
        Loading::start(images, move |image| load_one(&ctx, image))
    }
}

/// Things loaded by name on a thread of their own: those loaded so far, and the rest coming.
pub(crate) struct Loading<T> {
    loaded: HashMap<String, T>,
    /// Each as it loads, in the order given; closed once all have (or one failed).
    loading: Option<Receiver<Result<(String, T)>>>,
    /// Why loading stopped, where one failed.
    failed: Option<String>,
}

impl<T: Send + 'static> Loading<T> {
    /// Start loading `items` with `load`, in order, on a thread of their own.
    pub fn start<I: Send + 'static>(
        items: Vec<I>,
        load: impl Fn(I) -> Result<(String, T)> + Send + 'static,
    ) -> Result<Self> {
        let (send, receive) = channel();
        std::thread::Builder::new()
            .name("bbc-kernels".into())
            .spawn(move || {
                for item in items {
                    let loaded = load(item);
                    let failed = loaded.is_err();
                    // A closed channel: the device is gone, nothing needs the rest.
                    if send.send(loaded).is_err() || failed {
                        break;
                    }
                }
            })
            .map_err(|e| RuntimeError::Cuda(format!("starting the kernels' loading: {e}")))?;
        Ok(Self {
            loaded: HashMap::new(),
            loading: Some(receive),
            failed: None,
        })
    }

    /// `name`, once it has loaded.
    pub fn get(&mut self, name: &str) -> Result<&T> {
        while !self.loaded.contains_key(name) && self.loading.is_some() {
            self.receive_one()?;
        }
        match (self.loaded.get(name), &self.failed) {
            (Some(loaded), _) => Ok(loaded),
            (None, Some(why)) => Err(RuntimeError::Cuda(format!(
                "no kernel {name}: loading stopped at {why}"
            ))),
            (None, None) => Err(RuntimeError::Artifact(format!("no kernel {name}"))),
        }
    }

    /// Wait for every one: the error of the first that failed, if one did.
    pub fn all_loaded(&mut self) -> Result<()> {
        while self.loading.is_some() {
            self.receive_one()?;
        }
        match &self.failed {
            Some(why) => Err(RuntimeError::Cuda(format!("loading the kernels: {why}"))),
            None => Ok(()),
        }
    }

    /// The next one loaded, or the end of loading.
    fn receive_one(&mut self) -> Result<()> {
        let Some(loading) = &self.loading else { return Ok(()) };
        match loading.recv() {
            Ok(Ok((name, loaded))) => {
                self.loaded.insert(name, loaded);
                Ok(())
            }
            Ok(Err(e)) => {
                self.loading = None;
                self.failed = Some(e.to_string());
                Err(e)
            }
            // All loaded (or the loader stopped after the failure it sent).
            Err(_) => {
                self.loading = None;
                Ok(())
            }
        }
    }
}

/// `kernel`'s module read and loaded into `ctx`, its function allowed its shared memory.
fn load_one(ctx: &Arc<CudaContext>, kernel: KernelImage) -> Result<(String, LoadedKernel)> {
    let module = ctx.load_module(kernel.image.read()?).map_err(driver)?;
    let function = module.load_function(&kernel.name).map_err(driver)?;
    if kernel.shared_bytes as usize > kernels_gen::dsl::STATIC_SHARED_LIMIT {
        // Past 48 KiB a kernel must be allowed its dynamic shared memory first.
        let attribute = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        function
            .set_attribute(attribute, kernel.shared_bytes as i32)
            .map_err(driver)?;
    }
    let loaded = LoadedKernel {
        function,
        params: kernel.params,
        shared_bytes: kernel.shared_bytes,
        awaits_prior_kernel: kernel.awaits_prior_kernel,
    };
    Ok((kernel.name, loaded))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Loads `names` in order, each after the one before, failing at `fail` if given; counts
    /// how many it has loaded.
    fn loading(names: &[&str], fail: Option<&str>, count: Arc<AtomicUsize>) -> Loading<usize> {
        let items: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let fail = fail.map(str::to_string);
        Loading::start(items, move |name| {
            std::thread::sleep(std::time::Duration::from_millis(2));
            if Some(&name) == fail.as_ref() {
                return Err(RuntimeError::Cuda(format!("{name} refused")));
            }
            Ok((name, count.fetch_add(1, Ordering::SeqCst)))
        })
        .unwrap()
    }

    #[test]
    fn a_launch_waits_for_its_own_kernel_and_loading_for_all() {
        let count = Arc::new(AtomicUsize::new(0));
        let mut kernels = loading(&["fill", "gemv", "attention"], None, count.clone());
        // Each in the order given, the wait only as long as its own.
        assert_eq!(*kernels.get("fill").unwrap(), 0);
        assert_eq!(*kernels.get("attention").unwrap(), 2);
        kernels.all_loaded().unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 3);
        assert_eq!(*kernels.get("gemv").unwrap(), 1);
        assert!(kernels
            .get("missing")
            .unwrap_err()
            .to_string()
            .contains("no kernel missing"));
    }

    #[test]
    fn a_module_that_fails_fails_the_load_and_names_itself() {
        let count = Arc::new(AtomicUsize::new(0));
        let mut kernels = loading(&["fill", "bad", "gemv"], Some("bad"), count.clone());
        assert_eq!(*kernels.get("fill").unwrap(), 0);
        assert!(kernels.get("gemv").unwrap_err().to_string().contains("bad refused"));
        // Later asks say why, and so does waiting for all.
        assert!(kernels
            .get("gemv")
            .unwrap_err()
            .to_string()
            .contains("loading stopped at"));
        assert!(kernels.all_loaded().unwrap_err().to_string().contains("bad refused"));
        assert_eq!(count.load(Ordering::SeqCst), 1, "nothing loads after the failure");
    }
}
