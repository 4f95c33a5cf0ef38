//! The `CUresult` codes the double returns, with the text `cuGetErrorString` gives for each.
//!
//! Only codes that exist in the driver API's `cudaError_enum` are ever returned: the caller's
//! bindings read the result as that enum, so an unknown value would be undefined behaviour there.

/// A driver API result code (`CUresult`, a C enum of `unsigned int` size).
pub type CuResult = u32;

/// `CUDA_SUCCESS`.
pub const SUCCESS: CuResult = 0;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const OUT_OF_MEMORY: CuResult = 2;
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const NOT_INITIALIZED: CuResult = 3;
/// `CUDA_ERROR_DEINITIALIZED`.
pub const DEINITIALIZED: CuResult = 4;
/// `CUDA_ERROR_NO_DEVICE`.
pub const NO_DEVICE: CuResult = 100;
/// `CUDA_ERROR_INVALID_DEVICE`.
pub const INVALID_DEVICE: CuResult = 101;
/// `CUDA_ERROR_INVALID_IMAGE`.
pub const INVALID_IMAGE: CuResult = 200;
/// `CUDA_ERROR_INVALID_CONTEXT`.
pub const INVALID_CONTEXT: CuResult = 201;
/// `CUDA_ERROR_MAP_FAILED`.
pub const MAP_FAILED: CuResult = 205;
/// `CUDA_ERROR_ALREADY_MAPPED`.
pub const ALREADY_MAPPED: CuResult = 208;
/// `CUDA_ERROR_INVALID_PTX`.
pub const INVALID_PTX: CuResult = 218;
/// `CUDA_ERROR_OPERATING_SYSTEM`.
pub const OPERATING_SYSTEM: CuResult = 304;
/// `CUDA_ERROR_INVALID_HANDLE`.
pub const INVALID_HANDLE: CuResult = 400;
/// `CUDA_ERROR_ILLEGAL_STATE`.
pub const ILLEGAL_STATE: CuResult = 401;
/// `CUDA_ERROR_NOT_FOUND`.
pub const NOT_FOUND: CuResult = 500;
/// `CUDA_ERROR_NOT_READY`.
pub const NOT_READY: CuResult = 600;
/// `CUDA_ERROR_ILLEGAL_ADDRESS`.
pub const ILLEGAL_ADDRESS: CuResult = 700;
/// `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`.
pub const LAUNCH_OUT_OF_RESOURCES: CuResult = 701;
/// `CUDA_ERROR_LAUNCH_FAILED`.
pub const LAUNCH_FAILED: CuResult = 719;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const NOT_SUPPORTED: CuResult = 801;
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
pub const STREAM_CAPTURE_UNSUPPORTED: CuResult = 900;
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
pub const STREAM_CAPTURE_INVALIDATED: CuResult = 901;
/// `CUDA_ERROR_STREAM_CAPTURE_MERGE`.
pub const STREAM_CAPTURE_MERGE: CuResult = 902;
/// `CUDA_ERROR_STREAM_CAPTURE_UNMATCHED`.
pub const STREAM_CAPTURE_UNMATCHED: CuResult = 903;
/// `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`.
pub const STREAM_CAPTURE_UNJOINED: CuResult = 904;
/// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`.
pub const STREAM_CAPTURE_ISOLATION: CuResult = 905;
/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`.
pub const STREAM_CAPTURE_IMPLICIT: CuResult = 906;
/// `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`.
pub const STREAM_CAPTURE_WRONG_THREAD: CuResult = 908;
/// `CUDA_ERROR_UNKNOWN`.
pub const UNKNOWN: CuResult = 999;

/// `(code, NUL-terminated description)` for every code above.
const DESCRIPTIONS: &[(CuResult, &str)] = &[
    (SUCCESS, "no error\0"),
    (INVALID_VALUE, "invalid argument\0"),
    (OUT_OF_MEMORY, "out of memory\0"),
    (NOT_INITIALIZED, "initialization error\0"),
    (DEINITIALIZED, "driver shutting down\0"),
    (NO_DEVICE, "no CUDA-capable device is detected\0"),
    (INVALID_DEVICE, "invalid device ordinal\0"),
    (INVALID_IMAGE, "device kernel image is invalid\0"),
    (INVALID_CONTEXT, "invalid device context\0"),
    (MAP_FAILED, "mapping of buffer object failed\0"),
    (ALREADY_MAPPED, "resource already mapped\0"),
    (INVALID_PTX, "a PTX JIT compilation failed\0"),
    (
        OPERATING_SYSTEM,
        "OS call failed or operation not supported on this OS\0",
    ),
    (INVALID_HANDLE, "invalid resource handle\0"),
    (
        ILLEGAL_STATE,
        "the operation cannot be performed in the present state\0",
    ),
    (NOT_FOUND, "named symbol not found\0"),
    (NOT_READY, "device not ready\0"),
    (
        ILLEGAL_ADDRESS,
        "an illegal memory access was encountered\0",
    ),
    (
        LAUNCH_OUT_OF_RESOURCES,
        "too many resources requested for launch\0",
    ),
    (LAUNCH_FAILED, "unspecified launch failure\0"),
    (NOT_SUPPORTED, "operation not supported\0"),
    (
        STREAM_CAPTURE_UNSUPPORTED,
        "operation not permitted when stream is capturing\0",
    ),
    (
        STREAM_CAPTURE_INVALIDATED,
        "operation failed due to a previous error during capture\0",
    ),
    (
        STREAM_CAPTURE_MERGE,
        "operation would result in a merge of separate capture sequences\0",
    ),
    (
        STREAM_CAPTURE_UNMATCHED,
        "capture was not ended in the same stream as it began\0",
    ),
    (
        STREAM_CAPTURE_UNJOINED,
        "capturing stream has unjoined work\0",
    ),
    (
        STREAM_CAPTURE_ISOLATION,
        "dependency created on uncaptured work in another stream\0",
    ),
    (
        STREAM_CAPTURE_IMPLICIT,
        "operation would make the legacy stream depend on a capturing blocking stream\0",
    ),
    (
        STREAM_CAPTURE_WRONG_THREAD,
        "attempt to terminate a thread-local capture sequence from another thread\0",
    ),
    (UNKNOWN, "unknown error\0"),
];

/// The NUL-terminated description of `code`, or `None` for a code the double does not know.
pub fn describe(code: CuResult) -> Option<&'static str> {
    DESCRIPTIONS
        .iter()
        .find(|(c, _)| *c == code)
        .map(|(_, text)| *text)
}

/// The symbolic name of `code` (for reports).
pub fn name(code: CuResult) -> &'static str {
    match code {
        SUCCESS => "CUDA_SUCCESS",
        INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
        OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
        NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
        DEINITIALIZED => "CUDA_ERROR_DEINITIALIZED",
        NO_DEVICE => "CUDA_ERROR_NO_DEVICE",
        INVALID_DEVICE => "CUDA_ERROR_INVALID_DEVICE",
        INVALID_IMAGE => "CUDA_ERROR_INVALID_IMAGE",
        INVALID_CONTEXT => "CUDA_ERROR_INVALID_CONTEXT",
        MAP_FAILED => "CUDA_ERROR_MAP_FAILED",
        ALREADY_MAPPED => "CUDA_ERROR_ALREADY_MAPPED",
        INVALID_PTX => "CUDA_ERROR_INVALID_PTX",
        OPERATING_SYSTEM => "CUDA_ERROR_OPERATING_SYSTEM",
        INVALID_HANDLE => "CUDA_ERROR_INVALID_HANDLE",
        ILLEGAL_STATE => "CUDA_ERROR_ILLEGAL_STATE",
        NOT_FOUND => "CUDA_ERROR_NOT_FOUND",
        NOT_READY => "CUDA_ERROR_NOT_READY",
        ILLEGAL_ADDRESS => "CUDA_ERROR_ILLEGAL_ADDRESS",
        LAUNCH_OUT_OF_RESOURCES => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        LAUNCH_FAILED => "CUDA_ERROR_LAUNCH_FAILED",
        NOT_SUPPORTED => "CUDA_ERROR_NOT_SUPPORTED",
        STREAM_CAPTURE_UNSUPPORTED => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        STREAM_CAPTURE_INVALIDATED => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        STREAM_CAPTURE_MERGE => "CUDA_ERROR_STREAM_CAPTURE_MERGE",
        STREAM_CAPTURE_UNMATCHED => "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        STREAM_CAPTURE_UNJOINED => "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        STREAM_CAPTURE_ISOLATION => "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        STREAM_CAPTURE_IMPLICIT => "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        STREAM_CAPTURE_WRONG_THREAD => "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        _ => "CUDA_ERROR_UNKNOWN",
    }
}
