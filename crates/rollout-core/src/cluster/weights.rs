//! Weight versions between processes: a trainer snapshots its weights into buckets, serves
//! them, and generation workers pull them along a chain (trainer -> worker 0 -> worker 1 ...),
//! each relaying buckets as they arrive, so the trainer sends one copy of the model whatever
//! the number of workers. Every bucket is checksummed by its sender and verified by its
//! receiver. A version's checksum is XXH3-128 over its buckets' checksums and tensor tables
//! in order, so a receiver that verified every bucket has it without a second pass over the
//! bytes; it is the same for every process that buckets the same weights alike.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use rollout_net::gate::Gate;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{Hello, PullWeights, WeightsBucket, WeightsReport};
use rollout_net::rpc::{Incoming, Responder, RpcClient};
use rollout_net::{ClusterKey, NetError};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::roles::RoleError;

/// Folds bucket checksums, in order, into a version checksum.
#[derive(Default)]
pub(super) struct VersionHasher(twox_hash::XxHash3_128);

impl VersionHasher {
    pub(super) fn add(&mut self, bucket: &WeightsBucket) {
        self.0.write(&bucket.index.to_le_bytes());
        self.0.write(bucket.checksum.as_bytes());
        // The table too: the same bytes under other names or shapes are other weights.
        for meta in &bucket.tensors.tensors {
            self.0.write(&(meta.name.len() as u64).to_le_bytes());
            self.0.write(meta.name.as_bytes());
            self.0.write(meta.dtype.safetensors_name().as_bytes());
            for dim in &meta.shape {
                self.0.write(&dim.to_le_bytes());
            }
            self.0.write(&meta.offset.to_le_bytes());
            self.0.write(&meta.len.to_le_bytes());
        }
    }

    pub(super) fn finish(self) -> String {
        hex(self.0.finish_128())
    }
}

/// A digest as a bucket header's checksum ([`rollout_net::tensor::checksum`]'s form).
pub(super) fn hex(digest: u128) -> String {
    format!("{digest:032x}")
}

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error(transparent)]
    Net(#[from] NetError),
    #[error("weight bucket {index} of version {version} from {source_name} is corrupt: {reason}")]
    Corrupt {
        version: u64,
        index: u32,
        source_name: String,
        reason: String,
    },
    #[error("weight version {version} arrived with checksum {found}, but {expected} was published")]
    ChecksumMismatch {
        version: u64,
        expected: String,
        found: String,
    },
    #[error("weight version {version} was pulled unsealed, and {reason}")]
    Unsealed { version: u64, reason: String },
    #[error("{0}")]
    Tensor(#[from] rollout_net::TensorError),
    #[error("tensor `{name}` arrived in pieces that do not join: {reason}")]
    Pieces { name: String, reason: String },
}

/// A bucket as it travels: its header and payload.
#[derive(Debug, Clone)]
pub struct Bucket {
    pub header: WeightsBucket,
    pub payload: Payload,
}

/// A bucket's bytes: a buffer of its own, or pieces viewing a trainer's tensors in place
/// (see [`crate::cluster::in_place`]), sent back to back and hashed as they are written; its
/// header's checksum is empty until the first send (or the trainer) has hashed them.
#[derive(Debug, Clone)]
pub enum Payload {
    Owned(Bytes),
    InPlace(Arc<[Bytes]>),
}

impl Payload {
    pub fn len(&self) -> usize {
        match self {
            Payload::Owned(bytes) => bytes.len(),
            Payload::InPlace(pieces) => pieces.iter().map(Bytes::len).sum(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer of an owned payload.
    pub fn owned(&self) -> Option<&Bytes> {
        match self {
            Payload::Owned(bytes) => Some(bytes),
            Payload::InPlace(_) => None,
        }
    }

    /// The payload in one buffer (pieces are joined into a new one).
    pub(super) fn contiguous(&self) -> Bytes {
        match self {
            Payload::Owned(bytes) => bytes.clone(),
            Payload::InPlace(pieces) => Bytes::from(pieces.concat()),
        }
    }
}

/// One weight version, filled bucket by bucket (all at once on a trainer; as they arrive on
/// a relaying worker).
#[derive(Debug)]
pub struct VersionBuffer {
    pub version: u64,
    pub count: u32,
    buckets: std::sync::Mutex<Vec<Bucket>>,
    arrived: watch::Sender<u32>,
    /// How many buckets' checksums are known (see [`Payload::InPlace`]).
    hashed: watch::Sender<u32>,
}

impl VersionBuffer {
    pub(super) fn new(version: u64, count: u32) -> Self {
        Self {
            version,
            count,
            // Not sized from `count`: a peer's claim is no reason to allocate.
            buckets: std::sync::Mutex::new(Vec::new()),
            arrived: watch::channel(0).0,
            hashed: watch::channel(0).0,
        }
    }

    /// The allocations of this version's buckets, for the next version (see
    /// [`crate::cluster::buckets`]): those of buckets nothing else still holds.
    pub fn into_allocations(self) -> Vec<Vec<u8>> {
        let buckets = self.buckets.into_inner().unwrap_or_default();
        buckets
            .into_iter()
            .filter_map(|bucket| match bucket.payload {
                Payload::Owned(bytes) => bytes.try_into_mut().ok(),
                Payload::InPlace(_) => None,
            })
            .map(Vec::from)
            .collect()
    }

    pub(super) fn push(&self, bucket: Bucket) {
        let hashed = !bucket.header.checksum.is_empty();
        let arrived = match self.buckets.lock() {
            Ok(mut buckets) => {
                buckets.push(bucket);
                buckets.len() as u32
            }
            Err(_) => return,
        };
        if hashed {
            self.hashed.send_modify(|count| *count += 1);
        }
        self.arrived.send_replace(arrived);
    }

    /// Records the checksum of bucket `index`, hashed as it was sent or copied, unless one
    /// is known already; returns the one known before, if any.
    pub(super) fn record_checksum(&self, index: u32, digest: u128) -> Option<String> {
        let known = {
            let mut buckets = self.buckets.lock().ok()?;
            let header = &mut buckets.get_mut(index as usize)?.header;
            if header.checksum.is_empty() {
                header.checksum = hex(digest);
                None
            } else {
                Some(header.checksum.clone())
            }
        };
        if known.is_none() {
            self.hashed.send_modify(|count| *count += 1);
        }
        known
    }

    /// Replaces the payload of bucket `index` with `payload`.
    pub(super) fn replace_payload(&self, index: u32, payload: Payload) {
        if let Ok(mut buckets) = self.buckets.lock()
            && let Some(bucket) = buckets.get_mut(index as usize)
        {
            bucket.payload = payload;
        }
    }

    /// Whether every bucket's checksum is known.
    pub(super) fn is_hashed(&self) -> bool {
        *self.hashed.borrow() >= self.count
    }

    pub(super) fn bucket(&self, index: u32) -> Option<Bucket> {
        self.buckets
            .lock()
            .ok()
            .and_then(|buckets| buckets.get(index as usize).cloned())
    }

    /// Waits until bucket `index` has arrived.
    async fn wait_for(&self, index: u32, limit: Duration) -> Option<Bucket> {
        let mut arrived = self.arrived.subscribe();
        let ready = tokio::time::timeout(limit, arrived.wait_for(|&n| n > index)).await;
        match ready {
            Ok(Ok(_)) => self.bucket(index),
            _ => None,
        }
    }

    /// The version checksum once every bucket is in and hashed (a version being filled is
    /// sealed by its last bucket, one served in place by the last bucket's first send);
    /// `None` if that takes longer than `limit`.
    pub async fn sealed(&self, limit: Duration) -> Option<String> {
        let mut hashed = self.hashed.subscribe();
        let count = self.count;
        let whole = tokio::time::timeout(limit, hashed.wait_for(|&n| n >= count)).await;
        matches!(whole, Ok(Ok(_))).then(|| self.checksum())
    }

    /// `announced` (this version's report) with the checksum, once every bucket is in.
    pub async fn sealed_report(
        &self,
        announced: WeightsReport,
        limit: Duration,
    ) -> Result<WeightsReport, RoleError> {
        match self.sealed(limit).await {
            Some(checksum) => Ok(WeightsReport {
                checksum,
                ..announced
            }),
            None => Err(RoleError::Runtime(format!(
                "weight version {} was not whole within {} s",
                announced.version,
                limit.as_secs()
            ))),
        }
    }

    /// The version checksum (over the bucket checksums in order).
    pub fn checksum(&self) -> String {
        let mut hasher = VersionHasher::default();
        if let Ok(buckets) = self.buckets.lock() {
            for bucket in buckets.iter() {
                hasher.add(&bucket.header);
            }
        }
        hasher.finish()
    }

    pub fn bytes(&self) -> u64 {
        self.buckets
            .lock()
            .map(|b| b.iter().map(|b| b.payload.len() as u64).sum())
            .unwrap_or(0)
    }
}

/// The version a process serves: the newest it published or received. The controller
/// publishes a new version only after every generator has the previous one.
#[derive(Clone)]
pub struct WeightStore {
    current: watch::Sender<Option<Arc<VersionBuffer>>>,
    /// Payload bytes this process has sent to weight pullers.
    pub sent_bytes: Arc<AtomicU64>,
}

impl Default for WeightStore {
    fn default() -> Self {
        Self {
            current: watch::channel(None).0,
            sent_bytes: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl WeightStore {
    pub fn publish(&self, buffer: Arc<VersionBuffer>) {
        self.current.send_replace(Some(buffer));
    }

    pub fn current(&self) -> Option<Arc<VersionBuffer>> {
        self.current.borrow().clone()
    }

    /// Stops serving the current version (the controller publishes a version only once every
    /// generator has the one before) and returns its bucket allocations for the next version
    /// (see [`crate::cluster::buckets`]): none while a puller still holds the version.
    pub fn retire(&self) -> Vec<Vec<u8>> {
        self.current
            .send_replace(None)
            .and_then(|buffer| Arc::try_unwrap(buffer).ok())
            .map(VersionBuffer::into_allocations)
            .unwrap_or_default()
    }

    /// Waits until `version` (or a newer one) is being filled here.
    async fn wait_for_version(&self, version: u64, limit: Duration) -> Option<Arc<VersionBuffer>> {
        let mut current = self.current.subscribe();
        let found = tokio::time::timeout(
            limit,
            current.wait_for(|buffer| buffer.as_ref().is_some_and(|b| b.version >= version)),
        )
        .await;
        match found {
            Ok(Ok(buffer)) => buffer.clone(),
            _ => None,
        }
    }

    /// Accepts authenticated pullers on `listener` until the process ends. Connections
    /// that fail authentication are closed before anything they sent is parsed.
    pub fn serve(
        &self,
        listener: TcpListener,
        key: ClusterKey,
        hello: Hello,
        limits: LinkLimits,
        wait_limit: Duration,
    ) {
        let store = self.clone();
        Gate::new(key, hello, limits, "weight server: ").serve(listener, move |link| {
            let store = store.clone();
            async move { store.serve_link(link, wait_limit).await }
        });
    }

    async fn serve_link(&self, link: Link, wait_limit: Duration) {
        let peer = link.describe();
        let mut server = link.server();
        while let Some(incoming) = server.requests.recv().await {
            let responder = server.responder.clone();
            if let Err(err) = self.answer_pull(&incoming, &responder, wait_limit).await {
                tracing::warn!("weight server: {peer}: {err}");
                let _ = responder.fail(incoming.call, err.to_string());
            }
        }
    }

    async fn answer_pull(
        &self,
        incoming: &Incoming,
        responder: &Responder,
        wait_limit: Duration,
    ) -> Result<(), NetError> {
        let request: PullWeights = incoming.decode().map_err(|err| NetError::BadFrame {
            peer: "weight puller".into(),
            reason: err.to_string(),
        })?;
        let missing = |what: String| NetError::Remote {
            peer: "weight server".into(),
            message: what,
        };
        let buffer = self
            .wait_for_version(request.version, wait_limit)
            .await
            .ok_or_else(|| missing(format!("version {} never arrived here", request.version)))?;
        if buffer.version != request.version {
            return Err(missing(format!(
                "version {} was replaced by {} before it was pulled",
                request.version, buffer.version
            )));
        }
        for index in 0..buffer.count {
            let bucket = buffer
                .wait_for(index, wait_limit)
                .await
                .ok_or_else(|| missing(format!("bucket {index} never arrived here")))?;
            let more = index + 1 < buffer.count;
            self.sent_bytes
                .fetch_add(bucket.payload.len() as u64, Ordering::Relaxed);
            match bucket.payload {
                Payload::Owned(payload) => {
                    responder.reply(incoming.call, &bucket.header, payload, more)?;
                }
                Payload::InPlace(pieces) => {
                    let hashed = Arc::downgrade(&buffer);
                    let record = move |digest| {
                        if let Some(buffer) = hashed.upgrade() {
                            buffer.record_checksum(index, digest);
                        }
                    };
                    responder.reply_hashed(
                        incoming.call,
                        &bucket.header,
                        pieces.to_vec(),
                        more,
                        record,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Pulls `report.version` from `source`, verifying each bucket before storing it here
    /// (where this process's own weight server relays it on at once), then the whole
    /// version's checksum if `report` is sealed (else the caller checks
    /// [`VersionBuffer::checksum`] against the seal).
    pub async fn pull(
        &self,
        source: &RpcClient,
        report: &WeightsReport,
    ) -> Result<Arc<VersionBuffer>, WeightsError> {
        let source_name = source.describe().to_owned();
        let mut call = source.call(
            &PullWeights {
                version: report.version,
            },
            Bytes::new(),
        )?;
        let mut buffer: Option<Arc<VersionBuffer>> = None;
        let mut version_hasher = VersionHasher::default();
        while let Some(frame) = call.next_frame().await? {
            // Hashed by the decoder as the bytes arrived: no second pass over the payload.
            let found = frame.payload_checksum();
            let sender_hashed = frame.sender_hashed;
            let (mut header, more, payload) = call.decode::<WeightsBucket>(frame)?;
            if header.checksum.is_empty() && sender_hashed {
                // Served in place: the sender hashed it as it wrote it, the decoder checked.
                header.checksum.clone_from(&found);
            }
            let arrived = ArrivedBucket {
                header: &header,
                more,
                payload_len: payload.len() as u64,
                checksum: &found,
            };
            let expected_index = buffer.as_ref().map_or(0, |b| b.bucket_count_so_far());
            arrived
                .check(expected_index, report.version)
                .map_err(|reason| corrupt(report.version, header.index, &source_name, reason))?;
            let target = buffer.get_or_insert_with(|| {
                let buffer = Arc::new(VersionBuffer::new(report.version, header.count));
                self.publish(buffer.clone());
                buffer
            });
            if header.count != target.count {
                let reason = "the bucket count changed mid-version".into();
                return Err(corrupt(report.version, header.index, &source_name, reason));
            }
            version_hasher.add(&header);
            target.push(Bucket {
                header,
                payload: Payload::Owned(payload),
            });
        }
        whole_version(buffer, version_hasher, report, &source_name)
    }
}

/// The pulled `buffer` once the stream has ended: every bucket in, and the version checksum
/// `hasher` folded the one `report` published (if it is sealed).
fn whole_version(
    buffer: Option<Arc<VersionBuffer>>,
    hasher: VersionHasher,
    report: &WeightsReport,
    source_name: &str,
) -> Result<Arc<VersionBuffer>, WeightsError> {
    let buffer =
        buffer.ok_or_else(|| corrupt(report.version, 0, source_name, "no buckets".into()))?;
    if buffer.bucket_count_so_far() != buffer.count {
        let reason = "the stream ended early".into();
        return Err(corrupt(
            report.version,
            buffer.bucket_count_so_far(),
            source_name,
            reason,
        ));
    }
    let found = hasher.finish();
    if report.is_sealed() && found != report.checksum {
        return Err(WeightsError::ChecksumMismatch {
            version: report.version,
            expected: report.checksum.clone(),
            found,
        });
    }
    Ok(buffer)
}

/// A bucket as it came off the wire, before it is stored.
struct ArrivedBucket<'a> {
    header: &'a WeightsBucket,
    more: bool,
    payload_len: u64,
    /// The payload's checksum as computed while it was read.
    checksum: &'a str,
}

impl ArrivedBucket<'_> {
    /// In sequence for `version`, its payload the one the sender hashed, its tensor table
    /// within the payload; the reason it is corrupt otherwise.
    fn check(&self, expected_index: u32, version: u64) -> Result<(), String> {
        let header = self.header;
        if header.version != version
            || header.index != expected_index
            || header.count == 0
            || (self.more != (header.index + 1 < header.count))
        {
            return Err(format!(
                "out of sequence (version {}, bucket {} of {})",
                header.version, header.index, header.count
            ));
        }
        if self.checksum != header.checksum {
            return Err(format!(
                "checksum {}, the sender computed {}",
                self.checksum, header.checksum
            ));
        }
        header
            .tensors
            .validate(self.payload_len)
            .map_err(|err| err.to_string())
    }
}

fn corrupt(version: u64, index: u32, source_name: &str, reason: String) -> WeightsError {
    WeightsError::Corrupt {
        version,
        index,
        source_name: source_name.to_owned(),
        reason,
    }
}

/// The seal of a version pulled unsealed: waits until `seals` holds the sealed report of
/// `buffer`'s version and returns it if the buffer has its checksum.
pub async fn seal_of(
    buffer: &VersionBuffer,
    seals: &mut watch::Receiver<Option<WeightsReport>>,
    limit: Duration,
) -> Result<WeightsReport, WeightsError> {
    let version = buffer.version;
    let unsealed = |reason: String| WeightsError::Unsealed { version, reason };
    let arrived = seals.wait_for(|seal| seal.as_ref().is_some_and(|s| s.version >= version));
    let seal = match tokio::time::timeout(limit, arrived).await {
        Ok(Ok(seal)) => seal.as_ref().cloned(),
        Ok(Err(_)) => return Err(unsealed("its seal can no longer arrive".into())),
        Err(_) => {
            return Err(unsealed(format!(
                "no seal arrived within {} s",
                limit.as_secs()
            )));
        }
    };
    let Some(seal) = seal.filter(|seal| seal.version == version) else {
        return Err(unsealed("a later version was sealed instead".into()));
    };
    let found = buffer.checksum();
    if found != seal.checksum {
        return Err(WeightsError::ChecksumMismatch {
            version,
            expected: seal.checksum,
            found,
        });
    }
    Ok(seal)
}

impl VersionBuffer {
    fn bucket_count_so_far(&self) -> u32 {
        *self.arrived.borrow()
    }
}

#[cfg(test)]
#[path = "weights_tests.rs"]
pub(super) mod tests;
