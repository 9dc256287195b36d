//! A trainer's weights served to pullers in place (see [`rollout_core::cluster::in_place`]):
//! the arrays a policy lends stay alive while any bucket piece views them, and the version is
//! settled (copied) before a hook that may change the weights runs.

use std::time::Duration;

use bytes::Bytes;
use pyo3::prelude::*;
use rollout_core::cluster::in_place::ServedInPlace;
use rollout_net::Dtype;

use super::policy::PolicyPlugin;

/// How long settling waits for sends still holding a piece of the weights.
const SETTLE_LIMIT: Duration = Duration::from_secs(60);

/// The bytes of an array a policy lent, kept alive by a reference to it (dropped off the
/// GIL, the reference is released the next time the GIL is taken).
struct LentArray {
    _array: Py<PyAny>,
    start: *const u8,
    len: usize,
}

// The pointer is into the array's buffer, which lives as long as `_array` does; the policy
// does not write it while a piece is held (`PolicyPlugin::settle_served_version` runs before
// every hook that may), so it is only read, from any thread.
#[allow(unsafe_code)]
unsafe impl Send for LentArray {}
#[allow(unsafe_code)]
unsafe impl Sync for LentArray {}

impl AsRef<[u8]> for LentArray {
    fn as_ref(&self) -> &[u8] {
        // Valid for `len` bytes while `_array` is alive (see above).
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts(self.start, self.len)
        }
    }
}

/// A tensor's bytes lent in place: `array` (a contiguous `uint8` array) and its bytes.
pub(super) fn lent_bytes(array: &Bound<'_, PyAny>, bytes: &[u8]) -> Bytes {
    if bytes.is_empty() {
        return Bytes::new();
    }
    Bytes::from_owner(LentArray {
        _array: array.clone().unbind(),
        start: bytes.as_ptr(),
        len: bytes.len(),
    })
}

/// A tensor lent in place: name, dtype, shape, bytes.
pub(super) type LentTensor = (String, Dtype, Vec<u64>, Bytes);

impl PolicyPlugin {
    /// Serves `served` until the weights next change, settling the version served before.
    pub(super) fn keep_served_in_place(&self, py: Python<'_>, served: ServedInPlace) {
        self.settle_served_version(py);
        served.seal_unless_pulled();
        if let Ok(mut slot) = self.served_in_place.lock() {
            *slot = Some(served);
        }
    }

    /// Before a hook that may change the weights: copies the version served from them in
    /// place, if there is one, and waits until no send still reads them.
    pub(super) fn settle_served_version(&self, py: Python<'_>) {
        let Some(served) = self.served_in_place.lock().ok().and_then(|mut s| s.take()) else {
            return;
        };
        let version = served.buffer().version;
        let settled = tracing::info_span!("weights.settle", version)
            .in_scope(|| py.detach(|| served.settle(SETTLE_LIMIT)));
        if !settled {
            tracing::warn!(
                "weight version {version}: a send still held the weights {} s after the \
                 update was due; the update goes ahead, and a puller still reading them \
                 will fail the version's checksum",
                SETTLE_LIMIT.as_secs()
            );
        }
    }
}
