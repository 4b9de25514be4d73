//! NCCL's entry points, loaded from the library its packages install.
//!
//! cudarc's NCCL bindings load `libnccl.so` only, a name that exists where NCCL's `-dev`
//! package made the link; the runtime package and PyTorch's `nvidia-nccl-cu*` wheels install
//! `libnccl.so.2`. The few calls this backend makes are resolved here from
//! [`nccl_library_candidates`](crate::cuda::nccl_library_candidates) instead, with cudarc's
//! types for the handles and enums. Results come back as plain integers (a newer NCCL may
//! return codes the bindings' enum lacks), and an error carries NCCL's own text.

use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use libloading::Library;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

/// A failed NCCL call: its name, NCCL's code, NCCL's words for the code and its last error.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct NcclError(String);

impl std::fmt::Debug for NcclError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for NcclError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What an NCCL call returns here.
pub(crate) type NcclResult = Result<(), NcclError>;

const SUCCESS: c_int = 0;
/// Returned by calls on a non-blocking communicator still at work; this backend's are
/// blocking, but the code is not an error.
const IN_PROGRESS: c_int = 7;

type Comm = ncclComm_t;
type Stream = cudaStream_t;
type Dtype = ncclDataType_t;

/// The loaded library and the entry points this backend calls.
pub(crate) struct Nccl {
    /// Where it was loaded from, for messages.
    pub(crate) name: String,
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, ncclUniqueId, c_int) -> c_int,
    comm_abort: unsafe extern "C" fn(Comm) -> c_int,
    comm_destroy: unsafe extern "C" fn(Comm) -> c_int,
    comm_get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_last_error: unsafe extern "C" fn(Comm) -> *const c_char,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        Dtype,
        ncclRedOp_t,
        Comm,
        Stream,
    ) -> c_int,
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, Dtype, Comm, Stream) -> c_int,
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        Dtype,
        ncclRedOp_t,
        Comm,
        Stream,
    ) -> c_int,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        Dtype,
        c_int,
        Comm,
        Stream,
    ) -> c_int,
    send: unsafe extern "C" fn(*const c_void, usize, Dtype, c_int, Comm, Stream) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, Dtype, c_int, Comm, Stream) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    /// Keeps the entry points above valid; never unloaded.
    _library: Library,
}

/// NCCL, loaded on first use; an error says which libraries were tried and why each failed.
pub(crate) fn nccl() -> Result<&'static Nccl, String> {
    static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(|| load(&crate::cuda::nccl_library_candidates()))
        .as_ref()
        .map_err(Clone::clone)
}

/// The first of `candidates` that loads and has every entry point.
fn load(candidates: &[std::ffi::OsString]) -> Result<Nccl, String> {
    let mut failures = Vec::new();
    for name in candidates {
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
        match unsafe { Library::new(name) } {
            Ok(library) => return resolve(library, name.to_string_lossy().into_owned()),
            Err(e) => {
                // libloading's own words are "dlopen failed"; the loader's reason is its source.
                // (and names the library).
                let why = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
                failures.push(why);
            }
        }
    }
    Err(format!(
        "NCCL could not be loaded ({}). Put the directory holding libnccl.so.2 on \
         LD_LIBRARY_PATH (PyTorch's is `python3 -c \"import nvidia.nccl, os; \
         print(os.path.dirname(nvidia.nccl.__file__))\"`/lib), or set {} to its path",
        failures.join("; "),
        crate::cuda::NCCL_LIBRARY_VAR
    ))
}

fn resolve(library: Library, name: String) -> Result<Nccl, String> {
    macro_rules! entry {
        ($symbol:literal) => {
            // SAFETY: the symbol is NCCL's function of that name, whose C signature the
            // field's type spells; the pointer lives as long as `library`, which the struct
            // keeps forever.
            *unsafe { library.get(concat!($symbol, "\0").as_bytes()) }
                .map_err(|e| format!("{name} has no {}: {e}", $symbol))?
        };
    }
    Ok(Nccl {
        get_version: entry!("ncclGetVersion"),
        get_unique_id: entry!("ncclGetUniqueId"),
        comm_init_rank: entry!("ncclCommInitRank"),
        comm_abort: entry!("ncclCommAbort"),
        comm_destroy: entry!("ncclCommDestroy"),
        comm_get_async_error: entry!("ncclCommGetAsyncError"),
        get_error_string: entry!("ncclGetErrorString"),
        get_last_error: entry!("ncclGetLastError"),
        all_reduce: entry!("ncclAllReduce"),
        all_gather: entry!("ncclAllGather"),
        reduce_scatter: entry!("ncclReduceScatter"),
        broadcast: entry!("ncclBroadcast"),
        send: entry!("ncclSend"),
        recv: entry!("ncclRecv"),
        group_start: entry!("ncclGroupStart"),
        group_end: entry!("ncclGroupEnd"),
        name,
        _library: library,
    })
}

/// `ncclResult_t` names, for codes the messages print.
fn code_name(code: c_int) -> &'static str {
    match code {
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        _ => "ncclResult",
    }
}

/// A C string NCCL owns, copied (empty for null).
///
/// # Safety
/// `s` is null or a NUL-terminated string that lives for this call.
unsafe fn text(s: *const c_char) -> String {
    if s.is_null() {
        String::new()
    } else {
        // SAFETY: as the caller promises.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

impl Nccl {
    fn check(&self, call: &str, code: c_int) -> NcclResult {
        if code == SUCCESS || code == IN_PROGRESS {
            return Ok(());
        }
        // SAFETY: both return static or thread-local strings NCCL owns; the last error's
        // communicator argument is unused and may be null.
        let (words, last) = unsafe {
            (
                text((self.get_error_string)(code)),
                text((self.get_last_error)(std::ptr::null_mut())),
            )
        };
        let last = if last.is_empty() {
            String::new()
        } else {
            format!(" (last error: {last})")
        };
        Err(NcclError(format!(
            "{call}: {} ({code}): {words}{last}",
            code_name(code)
        )))
    }

    /// NCCL's version as one number (22809 for 2.28.9).
    pub(crate) fn version(&self) -> Result<i32, NcclError> {
        let mut v = 0;
        // SAFETY: writes one int.
        self.check("ncclGetVersion", unsafe { (self.get_version)(&mut v) })?;
        Ok(v)
    }

    /// A fresh unique id for a new communicator.
    pub(crate) fn unique_id(&self) -> Result<ncclUniqueId, NcclError> {
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes one id.
        self.check("ncclGetUniqueId", unsafe { (self.get_unique_id)(&mut id) })?;
        Ok(id)
    }

    /// Joins communicator `id` as `rank` of `n`; blocks until every member has.
    ///
    /// # Safety
    /// The calling thread's current CUDA context is the device the communicator is for.
    pub(crate) unsafe fn comm_init_rank(
        &self,
        n: i32,
        id: ncclUniqueId,
        rank: i32,
    ) -> Result<Comm, NcclError> {
        let mut comm = std::ptr::null_mut();
        // SAFETY: writes one handle; the context as the caller promises.
        let code = unsafe { (self.comm_init_rank)(&mut comm, n, id, rank) };
        self.check("ncclCommInitRank", code)?;
        Ok(comm)
    }

    /// # Safety
    /// `comm` is a live communicator, aborted or destroyed once.
    pub(crate) unsafe fn comm_abort(&self, comm: Comm) -> NcclResult {
        // SAFETY: as the caller promises.
        self.check("ncclCommAbort", unsafe { (self.comm_abort)(comm) })
    }

    /// # Safety
    /// `comm` is a live communicator, aborted or destroyed once.
    pub(crate) unsafe fn comm_destroy(&self, comm: Comm) -> NcclResult {
        // SAFETY: as the caller promises.
        self.check("ncclCommDestroy", unsafe { (self.comm_destroy)(comm) })
    }

    /// The error an asynchronous operation on `comm` met, if any.
    ///
    /// # Safety
    /// `comm` is a live communicator.
    pub(crate) unsafe fn comm_get_async_error(&self, comm: Comm) -> NcclResult {
        let mut status = SUCCESS;
        // SAFETY: a live communicator (the caller's promise); writes one int.
        let code = unsafe { (self.comm_get_async_error)(comm, &mut status) };
        self.check("ncclCommGetAsyncError", code)?;
        self.check("an asynchronous NCCL operation", status)
    }

    /// # Safety
    /// `send` and `recv` are device buffers of `count` elements of `dtype` on `comm`'s
    /// device, live until the work on `stream` completes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn all_reduce(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        op: ncclRedOp_t,
        comm: Comm,
        stream: Stream,
    ) -> NcclResult {
        // SAFETY: as the caller promises.
        let code = unsafe { (self.all_reduce)(send, recv, count, dtype, op, comm, stream) };
        self.check("ncclAllReduce", code)
    }

    /// # Safety
    /// `send` holds `count` elements, `recv` members × `count`, on `comm`'s device, live
    /// until the work on `stream` completes.
    pub(crate) unsafe fn all_gather(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        comm: Comm,
        stream: Stream,
    ) -> NcclResult {
        // SAFETY: as the caller promises.
        let code = unsafe { (self.all_gather)(send, recv, count, dtype, comm, stream) };
        self.check("ncclAllGather", code)
    }

    /// # Safety
    /// `send` holds members × `count` elements, `recv` `count`, on `comm`'s device, live
    /// until the work on `stream` completes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn reduce_scatter(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        op: ncclRedOp_t,
        comm: Comm,
        stream: Stream,
    ) -> NcclResult {
        // SAFETY: as the caller promises.
        let code = unsafe { (self.reduce_scatter)(send, recv, count, dtype, op, comm, stream) };
        self.check("ncclReduceScatter", code)
    }

    /// # Safety
    /// `send` and `recv` are device buffers of `count` elements on `comm`'s device, live
    /// until the work on `stream` completes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn broadcast(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        root: i32,
        comm: Comm,
        stream: Stream,
    ) -> NcclResult {
        // SAFETY: as the caller promises.
        let code = unsafe { (self.broadcast)(send, recv, count, dtype, root, comm, stream) };
        self.check("ncclBroadcast", code)
    }

    /// # Safety
    /// `buf` holds `count` elements on `comm`'s device, live until the work on `stream`
    /// completes.
    pub(crate) unsafe fn send(
        &self,
        buf: *const c_void,
        count: usize,
        dtype: Dtype,
        peer: i32,
        comm: Comm,
        stream: Stream,
    ) -> NcclResult {
        // SAFETY: as the caller promises.
        let code = unsafe { (self.send)(buf, count, dtype, peer, comm, stream) };
        self.check("ncclSend", code)
    }

    /// # Safety
    /// `buf` holds `count` elements on `comm`'s device, live until the work on `stream`
    /// completes.
    pub(crate) unsafe fn recv(
        &self,
        buf: *mut c_void,
        count: usize,
        dtype: Dtype,
        peer: i32,
        comm: Comm,
        stream: Stream,
    ) -> NcclResult {
        // SAFETY: as the caller promises.
        let code = unsafe { (self.recv)(buf, count, dtype, peer, comm, stream) };
        self.check("ncclRecv", code)
    }

    pub(crate) fn group_start(&self) -> NcclResult {
        // SAFETY: no arguments; opens a group on this thread.
        self.check("ncclGroupStart", unsafe { (self.group_start)() })
    }

    pub(crate) fn group_end(&self) -> NcclResult {
        // SAFETY: no arguments; closes this thread's group.
        self.check("ncclGroupEnd", unsafe { (self.group_end)() })
    }
}

#[cfg(test)]
mod tests;
