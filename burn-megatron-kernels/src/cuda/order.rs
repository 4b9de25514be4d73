//! Work on streams of our own (cuBLASLt's GEMMs, NCCL's collectives) ordered against
//! CubeCL's stream without stopping the host.
//!
//! cubecl-cuda queues each host thread's kernels on a stream it does not expose, so no CUDA
//! event can be recorded on it. What can be queued there is a kernel, and a kernel can write
//! and poll device memory, which the driver's stream memory operations
//! (`cuStreamWaitValue32`, `cuStreamWriteValue32`) read and write on our side:
//!
//! - *ours after CubeCL's*: a one-unit kernel on CubeCL's stream writes a counter once
//!   everything queued before it has run; our stream waits until the counter reaches it.
//! - *CubeCL's after ours*: our stream writes a second counter after its work; a one-unit
//!   kernel on CubeCL's stream polls it, so every later kernel there waits.
//!
//! Neither side waits on the host. [`StreamOrder::Host`] (`BURN_MEGATRON_STREAM_ORDER=host`)
//! does the same with host synchronisations instead (drain CubeCL's stream, then ours), for
//! comparison and as the fallback where the driver refuses stream memory operations.
//! [`order_stats`] counts both kinds.

use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

/// CubeCL's CUDA server, whose buffers' device addresses `get_resource` gives.
pub(crate) type CudaServer =
    <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;

/// The variable choosing [`StreamOrder`]: `device` (the default) or `host`.
pub const STREAM_ORDER_VAR: &str = "BURN_MEGATRON_STREAM_ORDER";

/// How work on our streams is ordered against CubeCL's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamOrder {
    /// On the device: a counter written by one side and awaited by the other.
    Device,
    /// On the host: a full synchronisation of CubeCL's stream before, of ours after.
    Host,
}

/// 0: as [`STREAM_ORDER_VAR`] says; 1: device; 2: host.
static OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// The order in use: [`set_stream_order`]'s, else the one [`STREAM_ORDER_VAR`] asks for (read
/// once); an unknown value is an error naming it.
pub fn stream_order() -> Result<StreamOrder, String> {
    static FROM_ENV: OnceLock<Result<StreamOrder, String>> = OnceLock::new();
    match OVERRIDE.load(Ordering::Relaxed) {
        1 => return Ok(StreamOrder::Device),
        2 => return Ok(StreamOrder::Host),
        _ => {}
    }
    FROM_ENV
        .get_or_init(|| parse_order(std::env::var(STREAM_ORDER_VAR).ok().as_deref()))
        .clone()
}

/// The order a value of [`STREAM_ORDER_VAR`] names (unset or empty: device).
fn parse_order(value: Option<&str>) -> Result<StreamOrder, String> {
    match value {
        None | Some("") | Some("device") => Ok(StreamOrder::Device),
        Some("host") => Ok(StreamOrder::Host),
        Some(other) => Err(format!(
            "{STREAM_ORDER_VAR}={other}: expected `device` or `host`"
        )),
    }
}

/// Overrides [`STREAM_ORDER_VAR`] for the rest of the process (`None`: back to it), so that a
/// benchmark compares both orders in one process. A device whose driver refused stream memory
/// operations stays on the host.
pub fn set_stream_order(order: Option<StreamOrder>) {
    let code = match order {
        None => 0,
        Some(StreamOrder::Device) => 1,
        Some(StreamOrder::Host) => 2,
    };
    OVERRIDE.store(code, Ordering::Relaxed);
}

/// What the ordering has done in this process so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OrderStats {
    /// Host waits for a whole stream: CubeCL's before our work, ours after it (host order,
    /// or a device whose driver refused stream memory operations).
    pub host_syncs: u64,
    /// Orderings done on the device (each a counter kernel and a stream memory operation).
    pub device_orders: u64,
}

static HOST_SYNCS: AtomicU64 = AtomicU64::new(0);
static DEVICE_ORDERS: AtomicU64 = AtomicU64::new(0);

/// The counts so far (differences between two calls count one step's).
pub fn order_stats() -> OrderStats {
    OrderStats {
        host_syncs: HOST_SYNCS.load(Ordering::Relaxed),
        device_orders: DEVICE_ORDERS.load(Ordering::Relaxed),
    }
}

/// Polls of the counter before a waiting kernel gives up (minutes on any GPU): a wait that
/// long means our stream died, and the kernel records it instead of hanging the device.
const POLL_LIMIT: u32 = 1 << 30;

#[cube(launch)]
fn signal_kernel(counter: &mut [u32], value: u32) {
    if UNIT_POS == 0 {
        counter[0] = value;
    }
}

#[cube(launch)]
fn wait_kernel(counter: &[Atomic<u32>], timed_out: &mut [u32], value: u32, limit: u32) {
    if UNIT_POS == 0 {
        let mut polls = 0u32;
        loop {
            if counter[0].load() >= value {
                break;
            }
            polls += 1;
            if polls >= limit {
                timed_out[0] = 1u32;
                break;
            }
        }
    }
}

/// One host thread's link with one device: the counters, their addresses, and our stream.
struct Link {
    client: cubecl::client::Client,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// CubeCL → us, us → CubeCL, and the waiting kernel's time-out flag.
    counters: [cubecl::server::Handle; 3],
    addresses: [u64; 3],
    /// Keep the counters' allocations in place while their addresses are in use.
    _pinned: Vec<Box<dyn std::any::Any>>,
    sent: u32,
    awaited: u32,
    /// Whether the driver takes stream memory operations here (else: host order always).
    on_device: bool,
}

thread_local! {
    /// This thread's link per device, or why it could not be made: a failure is kept, so
    /// that a GEMM falls back at once instead of making a context and a stream again.
    static LINKS: RefCell<HashMap<u16, Result<Link, String>>> = RefCell::new(HashMap::new());
}

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

impl Link {
    fn new(like: &CubeTensor) -> Result<Self, String> {
        let ordinal = like.device.to_id().index_id as usize;
        let context = CudaContext::new(ordinal).map_err(driver("CUDA context"))?;
        // With event tracking on (cudarc's default), a context's first stream synchronises the
        // whole device, with no bound: an NCCL collective or send in flight on another
        // stream would make it wait for a peer. Nothing here allocates through cudarc
        // (the counters are CubeCL's, the GEMM workspace is raw), so nothing needs it.
        // SAFETY: this context object is the link's own, and no slice was made on it.
        unsafe { context.disable_event_tracking() };
        let stream = context.new_stream().map_err(driver("CUDA stream"))?;
        let client = like.client.clone();
        let counters = [(); 3].map(|_| client.create_from_slice(&[0u8; 4]));
        let mut pinned: Vec<Box<dyn std::any::Any>> = Vec::new();
        let mut addresses = [0u64; 3];
        for (c, address) in counters.iter().zip(&mut addresses) {
            let resource = client
                .get_resource::<CudaServer>(c.clone())
                .map_err(|e| format!("counter address: {e:?}"))?;
            *address = resource.resource().ptr;
            pinned.push(Box::new(resource));
        }
        let mut link = Self {
            client,
            context,
            stream,
            counters,
            addresses,
            _pinned: pinned,
            sent: 0,
            awaited: 0,
            on_device: true,
        };
        // The zeros are written and both kernels compiled and loaded before any stream waits
        // on them (a module loaded while a stream waits could wait for it). The signal is
        // seen to write: a stream would wait for a signal that never comes with no limit.
        link.signal(1);
        link.sent = 1;
        link.wait(0);
        cubecl::future::block_on(link.client.sync()).map_err(|e| format!("CubeCL sync: {e:?}"))?;
        let written = link
            .client
            .read_one(link.counters[0].clone())
            .map_err(|e| format!("reading the signal: {e:?}"))?;
        let checked = if written[..] == 1u32.to_ne_bytes() {
            link.probe()
        } else {
            Err(format!("the signal kernel wrote {written:?}, not 1"))
        };
        if let Err(why) = checked {
            link.on_device = false;
            eprintln!("burn-megatron: {why}; CUDA streams are ordered on the host instead");
        }
        Ok(link)
    }

    /// One wait and one write on our stream, to learn whether the driver takes them.
    fn probe(&self) -> Result<(), String> {
        self.bind()?;
        let s = self.stream.cu_stream();
        // SAFETY: the counters are live device allocations of 4 bytes (pinned above), both
        // zero; a wait for ≥ 0 returns at once.
        unsafe {
            sys::cuStreamWaitValue32_v2(
                s,
                self.addresses[0],
                0,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
            .result()
            .map_err(driver("cuStreamWaitValue32"))?;
            sys::cuStreamWriteValue32_v2(
                s,
                self.addresses[1],
                0,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
            .result()
            .map_err(driver("cuStreamWriteValue32"))?;
        }
        self.stream.synchronize().map_err(driver("stream sync"))
    }

    fn bind(&self) -> Result<(), String> {
        self.context
            .bind_to_thread()
            .map_err(driver("CUDA context"))
    }

    fn signal(&self, value: u32) {
        // SAFETY: a 4-byte buffer holds one u32.
        let arg = unsafe { BufferArg::from_raw_parts(self.counters[0].clone(), 1) };
        signal_kernel::launch(
            &self.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            arg,
            value,
        );
    }

    fn wait(&self, value: u32) {
        // SAFETY: 4-byte buffers hold one u32 each.
        let (counter, flag) = unsafe {
            (
                BufferArg::from_raw_parts(self.counters[1].clone(), 1),
                BufferArg::from_raw_parts(self.counters[2].clone(), 1),
            )
        };
        wait_kernel::launch(
            &self.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            counter,
            flag,
            value,
            POLL_LIMIT,
        );
    }

    /// `stream` starts nothing more until CubeCL's stream has run what is queued on it.
    fn order(&self) -> Result<StreamOrder, String> {
        Ok(if self.on_device {
            stream_order()?
        } else {
            StreamOrder::Host
        })
    }

    /// Marks CubeCL's stream here, for another stream to wait on; `None` once CubeCL's stream
    /// has been drained from the host instead (host order).
    fn mark(&mut self, order: StreamOrder) -> Result<Option<CubeclSignal>, String> {
        match order {
            StreamOrder::Host => {
                HOST_SYNCS.fetch_add(1, Ordering::Relaxed);
                cubecl::future::block_on(self.client.sync())
                    .map_err(|e| format!("CubeCL sync: {e:?}"))?;
                Ok(None)
            }
            StreamOrder::Device => {
                self.sent = self.sent.wrapping_add(1).max(1);
                self.signal(self.sent);
                // CubeCL queues launches on the host and hands them to the GPU in batches
                // (cubecl-common's channel runs 32 at a time, or on a flush): unflushed, the
                // signal could stay on the host while a stream waits for it on the device,
                // and a caller waiting for that stream would wait for ever.
                self.client
                    .flush()
                    .map_err(|e| format!("CubeCL flush: {e:?}"))?;
                DEVICE_ORDERS.fetch_add(1, Ordering::Relaxed);
                Ok(Some(CubeclSignal {
                    context: self.context.clone(),
                    address: self.addresses[0],
                    value: self.sent,
                }))
            }
        }
    }

    fn before(&mut self, stream: sys::CUstream, order: StreamOrder) -> Result<(), String> {
        match self.mark(order)? {
            // SAFETY: `stream` is a stream of this device (the callers' contract), and this
            // thread, the signalling one, is alive.
            Some(signal) => unsafe { signal.wait_on(stream) },
            None => Ok(()),
        }
    }

    /// CubeCL's stream runs nothing more until our stream has run what is queued on it.
    fn after(&mut self, order: StreamOrder) -> Result<(), String> {
        match order {
            StreamOrder::Host => {
                HOST_SYNCS.fetch_add(1, Ordering::Relaxed);
                self.stream.synchronize().map_err(driver("stream sync"))
            }
            StreamOrder::Device => {
                self.awaited = self.awaited.wrapping_add(1).max(1);
                DEVICE_ORDERS.fetch_add(1, Ordering::Relaxed);
                // SAFETY: a live, pinned 4-byte counter written from our own stream only.
                let written = self.bind().and_then(|()| unsafe {
                    sys::cuStreamWriteValue32_v2(
                        self.stream.cu_stream(),
                        self.addresses[1],
                        self.awaited,
                        sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                    )
                    .result()
                    .map_err(driver("cuStreamWriteValue32"))
                });
                if let Err(why) = written {
                    // Nothing will make CubeCL's stream wait: the work queued on ours must
                    // be over before the caller lets CubeCL reuse its memory (callers rely
                    // on it: an error here means our work ran, and is complete).
                    HOST_SYNCS.fetch_add(1, Ordering::Relaxed);
                    self.stream.synchronize().map_err(driver("stream sync"))?;
                    return Err(why);
                }
                self.wait(self.awaited);
                Ok(())
            }
        }
    }
}

/// Runs `f` with this thread's link to `like`'s device, made on first use (a link that
/// could not be made is not tried again on this thread: its error comes back at once).
fn with_link<R>(
    like: &CubeTensor,
    f: impl FnOnce(&mut Link) -> Result<R, String>,
) -> Result<R, String> {
    let key = like.device.to_id().index_id;
    LINKS.with(|links| {
        let mut links = links.borrow_mut();
        let link = links.entry(key).or_insert_with(|| {
            // Said once: every later GEMM of this thread falls back without a word.
            Link::new(like).inspect_err(|why| {
                eprintln!(
                    "burn-megatron: warning: no stream of our own on CUDA device {key}: {why}; \
                     this thread's GEMMs run on cubek"
                )
            })
        });
        match link {
            Ok(link) => f(link),
            Err(why) => Err(format!("no link to CUDA device {key}: {why}")),
        }
    })
}

/// Makes `stream` (of `like`'s device) wait for everything CubeCL has queued on this thread's
/// stream, so that work queued there next reads what CubeCL wrote, `like` included.
pub fn wait_for_cubecl(like: &CubeTensor, stream: sys::CUstream) -> Result<(), String> {
    with_link(like, |link| {
        let order = link.order()?;
        link.before(stream, order)
    })
}

/// A point of one thread's CubeCL stream that a stream can be made to wait for from any
/// thread ([`signal_cubecl`]): the kernels CubeCL queued there before it have run once the
/// counter reaches the value.
#[derive(Debug, Clone)]
pub struct CubeclSignal {
    context: Arc<CudaContext>,
    address: u64,
    value: u32,
}

impl CubeclSignal {
    /// Queues on `stream` a wait for the signal: work queued there next starts after the
    /// kernels before it.
    ///
    /// # Safety
    /// `stream` is a live stream of the signal's device, and the signalling thread is still
    /// alive (its counter lives as long as it does).
    pub unsafe fn wait_on(&self, stream: sys::CUstream) -> Result<(), String> {
        self.context
            .bind_to_thread()
            .map_err(driver("CUDA context"))?;
        // SAFETY: a live, pinned 4-byte counter of the signalling thread's link and a live
        // stream of this context (as the caller promises). The counter only grows (one
        // writer, CubeCL's stream in order), so waiting for ≥ the value is exact.
        unsafe {
            sys::cuStreamWaitValue32_v2(
                stream,
                self.address,
                self.value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
            .result()
            .map_err(driver("cuStreamWaitValue32"))
        }
    }
}

/// Marks this thread's CubeCL stream (on `like`'s device) at this point, for a stream to wait
/// on later, from another thread if need be ([`CubeclSignal::wait_on`]): the overlapped
/// reduction's worker queues the wait right before its collective, so that a later bucket's
/// wait never sits in front of an earlier bucket's collective. `None` when streams are ordered
/// on the host: CubeCL's stream has then been drained already.
pub fn signal_cubecl(like: &CubeTensor) -> Result<Option<CubeclSignal>, String> {
    with_link(like, |link| {
        let order = link.order()?;
        link.mark(order)
    })
}

/// Runs `work` on this thread's stream of our own on `like`'s device, between CubeCL's
/// kernels: it starts after everything CubeCL queued so far, and CubeCL's later kernels start
/// after it. `work` gets the stream and the order in use, and its context is current.
pub fn on_our_stream<R>(
    like: &CubeTensor,
    work: impl FnOnce(&Arc<CudaStream>, StreamOrder) -> Result<R, String>,
) -> Result<R, String> {
    with_link(like, |link| {
        let stream = link.stream.clone();
        // One order for both halves, whatever `set_stream_order` does meanwhile.
        let order = link.order()?;
        link.before(stream.cu_stream(), order)?;
        // `work` calls CUDA libraries that need the device's context on this thread (host
        // order binds none).
        link.bind()?;
        let out = work(&stream, order);
        // Ordered even when `work` failed part-way: whatever it queued is waited for. An
        // error here comes after our stream was drained, so what `work` wrote is complete.
        link.after(order)?;
        out
    })
}

/// Whether a waiting kernel on this thread's CubeCL stream ever gave up (see
/// 2³⁰ polls); reads the flags, so it waits for CubeCL's stream.
pub fn check_waits() -> Result<(), String> {
    LINKS.with(|links| {
        let links = links.borrow();
        for (device, link) in links
            .iter()
            .filter_map(|(d, l)| Some((d, l.as_ref().ok()?)))
        {
            let bytes = link
                .client
                .read_one(link.counters[2].clone())
                .map_err(|e| format!("reading the wait flag: {e:?}"))?;
            if bytes.iter().any(|&b| b != 0) {
                return Err(format!(
                    "a kernel on CUDA device {device} stopped waiting for our stream after \
                     {POLL_LIMIT} polls: the results after it are not to be trusted"
                ));
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two kernels on whatever Cube device this machine has (lavapipe in CI: the same
    /// CubeCL IR as on CUDA, compiled to SPIR-V): the signal writes its value, the wait
    /// returns on a counter that has reached its value, and gives up, flagged, on one that
    /// never does.
    #[test]
    fn the_kernels_signal_wait_and_give_up() {
        let device = match crate::device::wgpu_cpu_device() {
            Ok(device) => device,
            // The cuda feature alone (no Vulkan runtime compiled in): nothing to run on.
            Err(why) if !cfg!(feature = "wgpu") => return eprintln!("not run: {why}"),
            Err(why) => panic!("the wgpu feature is on but no device opened: {why}"),
        };
        let burn::backend::DispatchDevice::Cube(cube) = device.as_dispatch() else {
            panic!("a wgpu device is a Cube device");
        };
        let client = cube.client();
        let word = |v: u32| client.create_from_slice(&v.to_le_bytes());
        let read = |h: &cubecl::server::Handle| {
            let bytes = client.read_one(h.clone()).unwrap();
            u32::from_le_bytes(bytes[..4].try_into().unwrap())
        };
        // SAFETY (all launches): each buffer holds one u32.
        let arg = |h: &cubecl::server::Handle| unsafe { BufferArg::from_raw_parts(h.clone(), 1) };
        let one = (CubeCount::Static(1, 1, 1), CubeDim::new_1d(1));

        let counter = word(0);
        signal_kernel::launch(&client, one.0.clone(), one.1, arg(&counter), 7);
        assert_eq!(read(&counter), 7);

        let (reached, flag) = (word(5), word(0));
        wait_kernel::launch(
            &client,
            one.0.clone(),
            one.1,
            arg(&reached),
            arg(&flag),
            5,
            1 << 20,
        );
        assert_eq!(read(&flag), 0, "a reached counter is no time-out");

        let (short, flag) = (word(4), word(0));
        wait_kernel::launch(&client, one.0, one.1, arg(&short), arg(&flag), 5, 1000);
        assert_eq!(
            read(&flag),
            1,
            "a counter that never arrives must time out, flagged"
        );
    }

    #[test]
    fn orders_parse_and_override() {
        assert_eq!(parse_order(None), Ok(StreamOrder::Device));
        assert_eq!(parse_order(Some("host")), Ok(StreamOrder::Host));
        let err = parse_order(Some("gpu")).unwrap_err();
        assert!(
            err.contains(STREAM_ORDER_VAR) && err.contains("gpu"),
            "{err}"
        );
        set_stream_order(Some(StreamOrder::Host));
        assert_eq!(stream_order(), Ok(StreamOrder::Host));
        set_stream_order(Some(StreamOrder::Device));
        assert_eq!(stream_order(), Ok(StreamOrder::Device));
        set_stream_order(None);
    }
}
