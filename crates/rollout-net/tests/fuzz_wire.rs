//! Fuzzing the wire (issue 9's chaos suite, the fast cases): random and mutated bytes through
//! the frame decoder, every message kind's parse, both sides of the handshake in memory, and a
//! live listener over loopback TCP. Nothing panics, failures are typed errors, the listener
//! keeps serving, and however long a frame claims to be, no single allocation exceeds the
//! configured maximum frame size. The long campaign is `examples/fuzz_campaign.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod fuzz_support;

use std::sync::LazyLock;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fuzz_support::*;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rollout_net::auth::{authenticate_client, authenticate_server};
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{Done, Hello, PullWeights};
use rollout_net::rpc::RpcServer;
use rollout_net::{ClusterKey, Frame, FrameCodec, MessageKind, NetError};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::{Builder, Runtime};
use tokio::sync::mpsc;
use tokio_util::codec::Encoder;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| Fixture::new().unwrap());

const LIMIT: Duration = Duration::from_secs(20);
/// With the default limits (64 GiB payloads) the decoder allocates at most 8 MiB ahead of the
/// bytes that arrived, whatever a frame claims. These inputs are a few KiB.
const DEFAULT_LIMITS_BOUND: usize = (8 << 20) + (64 << 10);

fn runtime() -> Runtime {
    Builder::new_current_thread().enable_all().build().unwrap()
}

/// Runs `input` (a panic fails the test by itself) and checks the other properties: no
/// single allocation past the maximum frame size.
fn check(input: &Input) -> Result<(), TestCaseError> {
    let runtime = runtime();
    let bound = ALLOCATION_BOUND;
    let (result, largest) = measure(|| FIXTURE.run(input, &runtime));
    let path = input.path();
    prop_assert!(result.is_ok(), "{path}: {result:?}");
    prop_assert!(
        largest <= bound,
        "{path}: a single allocation of {largest} bytes, the bound is {bound}"
    );
    Ok(())
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let value = prop_oneof![3 => select(INTERESTING), 1 => any::<u64>()];
    let token = select(TOKENS).prop_map(<[u8]>::to_vec);
    prop_oneof![
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        2 => (any::<usize>(), any::<usize>(), value)
            .prop_map(|(frame, field, value)| Mutation::Field { frame, field, value }),
        1 => (any::<usize>(), vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), token).prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), 1..32usize).prop_map(|(at, len)| Mutation::Remove { at, len }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        1 => (any::<usize>(), 1..64usize, any::<usize>())
            .prop_map(|(from, len, at)| Mutation::Duplicate { from, len, at }),
    ]
}

/// Whole inputs at once, or pieces as small as a socket may deliver.
fn chunk() -> impl Strategy<Value = usize> {
    prop_oneof![Just(usize::MAX), 1..64usize]
}

/// Random bytes, or a well-formed handshake message of `len` bytes, mutated.
fn handshake_bytes(len: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..160),
        vec(mutation(), 0..4).prop_map(move |mutations| mutated(
            handshake_template(len),
            &[0],
            &mutations
        )),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn random_bytes_reach_the_decoder(
        mut bytes in vec(any::<u8>(), 0..1024),
        rlt in any::<bool>(),
        chunk in chunk(),
    ) {
        if rlt {
            bytes.splice(0..0, *b"RLT\x01");
        }
        check(&Input::Stream { bytes, chunk })?;
    }

    #[test]
    fn mutated_frames_reach_the_decoder(
        seeds in vec(any::<usize>(), 1..4),
        mutations in vec(mutation(), 1..8),
        chunk in chunk(),
    ) {
        check(&Input::Frames { seeds, mutations, chunk })?;
    }

    #[test]
    fn mutated_headers_of_every_kind_parse_or_fail_typed(
        seed in any::<usize>(),
        mutations in vec(mutation(), 1..6),
    ) {
        check(&Input::Header { seed, mutations })?;
    }

    #[test]
    fn default_limits_bound_what_a_claim_reserves(
        seeds in vec(any::<usize>(), 1..3),
        mutations in vec(mutation(), 1..4),
        chunk in chunk(),
    ) {
        let input = Input::Frames { seeds, mutations, chunk };
        let bytes = FIXTURE.wire_bytes(&input);
        let (result, largest) = measure(|| decode_stream(&FrameCodec::new(), &bytes, chunk));
        prop_assert!(result.is_ok(), "{result:?}");
        prop_assert!(largest <= DEFAULT_LIMITS_BOUND, "a single allocation of {largest} bytes");
    }

    #[test]
    fn a_listener_refuses_fuzzed_clients(bytes in handshake_bytes(HANDSHAKE_LENGTHS[1])) {
        check(&Input::Listener { bytes })?;
    }

    #[test]
    fn a_connector_refuses_fuzzed_servers(
        bytes in handshake_bytes(HANDSHAKE_LENGTHS[0] + HANDSHAKE_LENGTHS[2]),
    ) {
        check(&Input::Connector { bytes })?;
    }

    #[test]
    fn a_handshake_mutated_in_flight_fails_safely(
        message in 0..4usize,
        mutations in vec(mutation(), 0..4),
    ) {
        check(&Input::Relay { message, mutations })?;
    }

    #[test]
    fn campaign_inputs_hold_too(seed in any::<u64>()) {
        let input = FIXTURE.random_input(&mut StdRng::seed_from_u64(seed));
        check(&input)?;
    }
}

#[test]
fn every_kind_has_seeds_that_parse() {
    for kind in MessageKind::ALL {
        let seeds: Vec<&Frame> = FIXTURE.seeds.iter().filter(|s| s.kind == kind).collect();
        assert_eq!(seeds.len(), 2, "a bare and an enveloped seed of {kind}");
        for seed in seeds {
            assert!(decode_frame(seed) >= 1, "{seed:?} does not parse as {kind}");
        }
    }
    let weights = FIXTURE.seeds.iter().filter(|s| !s.payload.is_empty());
    for seed in weights {
        assert!(
            decode_frame(seed) >= 2,
            "{seed:?}: its tensors do not check out"
        );
    }
}

/// A preamble of a `WeightsBucket` frame claiming a header and a payload of these lengths.
fn claim(header_len: u32, payload_len: u64) -> Vec<u8> {
    let mut preamble = b"RLT\x01\x00\x14\x00\x00".to_vec();
    preamble.extend_from_slice(&header_len.to_be_bytes());
    preamble.extend_from_slice(&[0; 4]);
    preamble.extend_from_slice(&payload_len.to_be_bytes());
    preamble
}

/// A small frame is read whole into the decoder's buffer, so its claim is reserved at once
/// (which shows the measurement sees reservations); a large payload's claim reserves nothing
/// before its bytes arrive.
#[test]
fn the_allocator_sees_what_a_claim_reserves() {
    let small = 60_000;
    let preamble = claim(0, small);
    let (frames, largest) = measure(|| decode_stream(&FIXTURE.codec, &preamble, usize::MAX));
    assert_eq!(frames, Ok(0));
    assert!(largest > small as usize, "{largest} bytes");
    assert!(largest <= ALLOCATION_BOUND, "{largest} bytes");
    let preamble = claim(0, MAX_PAYLOAD_BYTES);
    let (frames, largest) = measure(|| decode_stream(&FIXTURE.codec, &preamble, usize::MAX));
    assert_eq!(frames, Ok(0));
    assert!(largest < small as usize, "{largest} bytes");
}

#[test]
fn claims_cost_at_most_the_max_frame_size_after_other_frames() {
    let heartbeat = FIXTURE
        .seeds
        .iter()
        .position(|s| s.kind == MessageKind::Heartbeat);
    let heartbeat = FIXTURE.wires[heartbeat.unwrap()].clone();
    let big = Frame {
        kind: MessageKind::WeightsBucket,
        header: Bytes::from_static(b"{\"seq\":1}"),
        payload: Bytes::from(vec![7; MAX_PAYLOAD_BYTES as usize - 1000]),
        payload_xxh3: None,
        sender_hashed: false,
    };
    let mut wire = BytesMut::new();
    FIXTURE.codec.clone().encode(big, &mut wire).unwrap();
    // Observed: the bound plus the heartbeat's 33 bytes; 1.9 times the bound.
    for before in [heartbeat, wire.to_vec()] {
        let mut bytes = before;
        bytes.extend(claim(MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES));
        let (frames, largest) = measure(|| decode_stream(&FIXTURE.codec, &bytes, usize::MAX));
        assert_eq!(frames, Ok(1));
        assert!(largest <= ALLOCATION_BOUND, "{largest} bytes");
    }
}

#[test]
fn default_limits_reserve_at_most_8_mib_ahead() {
    let mut bytes = claim(16 << 20, 0);
    bytes.push(b'{');
    let (frames, largest) = measure(|| decode_stream(&FrameCodec::new(), &bytes, 24));
    assert_eq!(frames, Ok(0));
    assert!(largest <= (8 << 20) + bytes.len(), "{largest} bytes");
}

#[test]
fn every_bit_flip_and_truncation_of_every_seed_is_handled() {
    let runtime = runtime();
    let mut cases = 0;
    for (seed, wire) in FIXTURE.wires.iter().enumerate() {
        let mut inputs = Vec::new();
        for at in 0..wire.len() {
            inputs.extend((0..8).map(|bit| Mutation::Flip { at, bit }));
            inputs.push(Mutation::Truncate { at });
        }
        for mutation in inputs {
            let (result, largest) = measure(|| {
                let input = Input::Frames {
                    seeds: vec![seed],
                    mutations: vec![mutation.clone()],
                    chunk: usize::MAX,
                };
                FIXTURE.run(&input, &runtime)
            });
            assert!(result.is_ok(), "{mutation:?} of seed {seed}: {result:?}");
            assert!(largest <= ALLOCATION_BOUND, "{mutation:?}: {largest} bytes");
            cases += 1;
        }
    }
    assert!(cases > 10_000, "{cases} cases");
}

fn limits() -> LinkLimits {
    LinkLimits {
        max_header_bytes: MAX_HEADER_BYTES,
        max_payload_bytes: MAX_PAYLOAD_BYTES,
        heartbeat: Duration::from_millis(100),
        peer_timeout: Duration::from_secs(5),
        handshake_timeout: Duration::from_secs(5),
        ..LinkLimits::default()
    }
}

fn hello(role: &str) -> Hello {
    Hello {
        role: role.into(),
        name: format!("{role}-fuzz"),
        version: "fuzz".into(),
        credits: 4,
        info: serde_json::Value::Null,
    }
}

fn hello_bytes() -> Vec<u8> {
    let mut wire = BytesMut::new();
    let frame = Frame::from_message(&hello("peer"), Bytes::new()).unwrap();
    FrameCodec::new().encode(frame, &mut wire).unwrap();
    wire.to_vec()
}

/// How far a garbage peer follows the protocol before its garbage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    BeforeAuth,
    BeforeHello,
    AfterHello,
}

fn garbage(rng: &mut StdRng) -> (Stage, Vec<u8>) {
    let stage = [Stage::BeforeAuth, Stage::BeforeHello, Stage::AfterHello][rng.random_range(0..3)];
    (stage, FIXTURE.wire_bytes(&FIXTURE.random_input(rng)))
}

/// Sends `bytes` once `stage` is reached, hangs up, and reads until the peer has gone;
/// `listening`: this side accepted the connection, so it challenges in the handshake.
async fn misbehave(mut stream: TcpStream, stage: Stage, bytes: &[u8], listening: bool) {
    if stage != Stage::BeforeAuth {
        let key = &FIXTURE.key;
        let authenticated = if listening {
            authenticate_client(&mut stream, key, b"", LIMIT).await
        } else {
            authenticate_server(&mut stream, key, b"", LIMIT).await
        };
        authenticated.unwrap();
    }
    if stage == Stage::AfterHello {
        stream.write_all(&hello_bytes()).await.unwrap();
    }
    let _ = stream.write_all(bytes).await;
    let _ = stream.shutdown().await;
    let _ = tokio::io::copy(&mut stream, &mut tokio::io::sink()).await;
}

/// Answers every request with `Done`; returns why the connection ended.
async fn answer(mut server: RpcServer) -> String {
    while let Some(request) = server.requests.recv().await {
        decode_frame(&request.frame);
        let _ = server
            .responder
            .reply(request.call, &Done {}, Bytes::new(), false);
    }
    server.closed_reason()
}

/// Accepts links until the test ends, reporting how each connection ended.
async fn serve(socket: TcpListener, key: ClusterKey, ended: mpsc::UnboundedSender<String>) {
    while let Ok((stream, _)) = socket.accept().await {
        let (key, ended) = (key.clone(), ended.clone());
        tokio::spawn(async move {
            let outcome = match Link::accept(stream, &key, &hello("worker"), &limits()).await {
                Ok(link) => answer(link.server()).await,
                Err(err) => err.to_string(),
            };
            let _ = ended.send(outcome);
        });
    }
}

async fn well_behaved_call(addr: &str) {
    let link = Link::connect(addr, &FIXTURE.key, &hello("controller"), &limits())
        .await
        .unwrap();
    let client = link.client();
    let call = client.request::<PullWeights, Done>(&PullWeights { version: 1 }, Bytes::new());
    let (done, _) = tokio::time::timeout(LIMIT, call).await.unwrap().unwrap();
    assert_eq!(done, Done {});
}

/// How the listener ended a garbage client's connection shows how far the garbage got.
fn assert_reached(stage: Stage, outcome: &str) {
    let refused = outcome.contains("authentication failed");
    let linked = outcome.contains("`peer-fuzz`");
    let reached = match stage {
        Stage::BeforeAuth => refused,
        Stage::BeforeHello => !refused && !linked,
        Stage::AfterHello => linked,
    };
    assert!(reached, "{stage:?}: {outcome}");
}

#[test]
fn a_live_listener_survives_garbage_clients() {
    let runtime = runtime();
    let (sent, largest) = measure(|| {
        runtime.block_on(async {
            let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = socket.local_addr().unwrap().to_string();
            let (ended, mut outcomes) = mpsc::unbounded_channel();
            tokio::spawn(serve(socket, FIXTURE.key.clone(), ended));
            let mut rng = StdRng::seed_from_u64(9);
            let mut sent = 0;
            for case in 1..=96 {
                let (stage, bytes) = garbage(&mut rng);
                sent = sent.max(bytes.len());
                let stream = TcpStream::connect(&addr).await.unwrap();
                misbehave(stream, stage, &bytes, false).await;
                let outcome = tokio::time::timeout(LIMIT, outcomes.recv()).await;
                let outcome = outcome.expect("the listener ends the connection").unwrap();
                assert_reached(stage, &outcome);
                if case % 32 == 0 {
                    well_behaved_call(&addr).await;
                    let outcome = outcomes.recv().await.unwrap();
                    assert!(outcome.ends_with("closed the connection"), "{outcome}");
                }
            }
            sent
        })
    });
    assert!(largest <= ALLOCATION_BOUND + sent, "{largest} bytes");
}

/// Garbage before the greeting fails the connection at that step; after it, the call ends
/// (with an answer, if the garbage held one, or a typed error).
fn assert_failed_at(stage: Stage, result: &Result<(), NetError>) {
    let reached = match result {
        // A challenge cut short reads as a busy listener: worth connecting again.
        Err(NetError::Auth { .. } | NetError::Connect { .. }) => Stage::BeforeAuth,
        Err(NetError::Handshake { .. }) => Stage::BeforeHello,
        _ => Stage::AfterHello,
    };
    assert_eq!(reached, stage, "{result:?}");
}

#[test]
fn a_connecting_peer_survives_garbage_servers() {
    let runtime = runtime();
    let (sent, largest) = measure(|| {
        runtime.block_on(async {
            let mut rng = StdRng::seed_from_u64(10);
            let mut sent = 0;
            for _ in 0..48 {
                let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = socket.local_addr().unwrap().to_string();
                let (stage, bytes) = garbage(&mut rng);
                sent = sent.max(bytes.len());
                let server = tokio::spawn(async move {
                    let (stream, _) = socket.accept().await.unwrap();
                    misbehave(stream, stage, &bytes, true).await;
                });
                let call = async {
                    let link = Link::connect(&addr, &FIXTURE.key, &hello("c"), &limits()).await?;
                    let call = link
                        .client()
                        .call(&PullWeights { version: 1 }, Bytes::new())?;
                    call.answer::<Done>().await.map(drop)
                };
                let result = tokio::time::timeout(LIMIT, call).await.unwrap();
                assert_failed_at(stage, &result);
                tokio::time::timeout(LIMIT, server).await.unwrap().unwrap();
            }
            sent
        })
    });
    assert!(largest <= ALLOCATION_BOUND + sent, "{largest} bytes");
}
