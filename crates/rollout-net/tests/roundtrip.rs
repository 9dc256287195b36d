//! Every message kind through the codec, and the decoder against arbitrary input.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use proptest::collection::{btree_map, vec};
use proptest::num::{f32 as pf32, f64 as pf64};
use proptest::prelude::*;
use proptest::sample::Index;
use rollout_net::messages::*;
use rollout_net::tensor::{Dtype, TensorPayloadBuilder, checksum};
use rollout_net::{Frame, FrameCodec, FrameError};
use tokio_util::codec::{Decoder, Encoder};

fn encode(frame: Frame) -> BytesMut {
    let mut wire = BytesMut::new();
    FrameCodec::new().encode(frame, &mut wire).unwrap();
    wire
}

/// Sends `message` and `payload` through the codec, the wire bytes split in two at `split`.
fn round_trip<M: Message + PartialEq + std::fmt::Debug>(
    message: &M,
    payload: Vec<u8>,
    split: usize,
) {
    let payload = Bytes::from(payload);
    let frame = Frame::from_message(message, payload.clone()).unwrap();
    let wire = encode(frame.clone());
    let split = split.min(wire.len());
    let mut codec = FrameCodec::new();
    let mut buf = BytesMut::from(&wire[..split]);
    let early = codec.decode(&mut buf).unwrap();
    assert!(early.is_none() || split == wire.len());
    buf.extend_from_slice(&wire[split..]);
    let decoded = match early {
        Some(frame) => frame,
        None => codec.decode(&mut buf).unwrap().expect("a whole frame"),
    };
    assert!(buf.is_empty());
    assert_eq!(decoded, frame);
    assert_eq!(decoded.kind, M::KIND);
    assert_eq!(decoded.payload, payload);
    assert_eq!(&decoded.decode_message::<M>().unwrap(), message);
}

fn report() -> WeightsReport {
    WeightsReport {
        version: 3,
        checksum: "ab".repeat(32),
        bytes: 8,
        source: "127.0.0.1:9000".into(),
        holder: "trainer-0".into(),
    }
}

fn samples() -> Vec<Frame> {
    let sampling = SamplingParams {
        max_new_tokens: 16,
        temperature: 0.7,
        top_p: 0.95,
        top_k: 0,
        stop_token_ids: vec![2],
        stop_strings: vec!["\n\n".into()],
        ignore_eos: false,
        seed: 42,
    };
    let mut builder = TensorPayloadBuilder::new();
    builder
        .push(
            "lm_head.weight",
            Dtype::BF16,
            vec![2, 2],
            &[1, 2, 3, 4, 5, 6, 7, 8],
        )
        .unwrap();
    let (tensors, payload) = builder.finish();
    let weights = WeightsUpdate {
        version: 3,
        checksum: checksum(&payload),
        tensors,
    };
    let frames = vec![
        Frame::from_message(
            &Hello {
                role: "trainer".into(),
                name: "trainer-0".into(),
                version: "0.1.0".into(),
                credits: 16,
                info: serde_json::json!({"rank": 0, "world_size": 2}),
            },
            Bytes::new(),
        ),
        Frame::from_message(&Heartbeat { seq: 9 }, Bytes::new()),
        Frame::from_message(
            &ErrorMessage {
                message: "out of memory".into(),
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &GenerateRequest {
                prompts: vec![PromptRequest {
                    prompt_ids: vec![1, 2, 3],
                    n: 4,
                    max_new_tokens: vec![8, 16, 8, 128],
                    seed: Some(9),
                    group: Some(rollout_net::messages::GroupRef { step: 3, index: 1 }),
                }],
                sampling,
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &GenerateResponse {
                groups: vec![vec![Completion {
                    token_ids: vec![5, 2],
                    logprobs: vec![-0.5, -1.25],
                    finish_reason: FinishReason::Stop,
                    weight_version: 3,
                }]],
                metrics: BTreeMap::from([("engine/kv_utilisation".to_owned(), 0.5)]),
                producers: Vec::new(),
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &ScoreRequest {
                samples: vec![ScoreSample {
                    prompt: "1+1=".into(),
                    completion: "2".into(),
                    record: serde_json::json!({"answer": "2", "tags": [1, 2.5, null]}),
                    finish_reason: FinishReason::Length,
                }],
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &ScoreResponse {
                totals: vec![1.0],
                components: vec![RewardComponent {
                    name: "exact".into(),
                    weight: 1.0,
                    scores: vec![1.0],
                }],
                failed: vec![ScoreFailure {
                    index: 0,
                    reason: FailureReason::Timeout,
                    message: "timed out after 2 s".into(),
                    reward: Some("exact".into()),
                    environment: None,
                    traceback: None,
                }],
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &TrainRequest {
                micro_batches: vec![MicroBatch {
                    rows: 1,
                    width: 2,
                    input_ids: vec![1, 2],
                    attention_mask: vec![1, 1],
                    loss_mask: vec![0.0, 1.0],
                    advantages: vec![0.0, 0.5],
                    old_logprobs: vec![0.0, -0.1],
                    loss_scale: 1.0,
                    objective: Objective::Grpo {
                        clip_low: 0.2,
                        clip_high: 0.28,
                        kl_coef: 0.0,
                        temperature: 1.0,
                        kl_penalty: KlPenalty::Loss,
                        correction: RolloutCorrection {
                            mode: CorrectionMode::Mis,
                            cap: 2.0,
                            band: [0.5, 2.0],
                            level: CorrectionLevel::Sequence,
                        },
                    },
                    returns: vec![],
                    old_values: vec![],
                    row_staleness: vec![1],
                }],
                learning_rate: 1e-6,
                epochs: 1,
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &TrainResponse {
                metrics: BTreeMap::from([("loss".to_owned(), 0.25)]),
                weight_version: 4,
                excluded: vec![ExcludedRow {
                    micro_batch: 1,
                    row: 3,
                    reason: Exclusion::NonFinite,
                }],
            },
            Bytes::new(),
        ),
        Frame::from_message(&weights, payload.clone()),
        Frame::from_message(
            &Welcome {
                config_toml: "[run]\nsteps = 3\n".into(),
                assignment: serde_json::json!({"index": 1}),
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &TokenizerRequest::Encode {
                texts: vec!["1+1=".into()],
                continuation: false,
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &TokenizerResponse::Ids {
                ids: vec![vec![1, 2]],
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &CheckpointRequest::Restore {
                directory: "runs/x/checkpoints/step-00000002/policy".into(),
                weight_version: 2,
            },
            Bytes::new(),
        ),
        Frame::from_message(&Done {}, Bytes::new()),
        Frame::from_message(
            &PublishWeights {
                bucket_bytes: 1 << 20,
            },
            Bytes::new(),
        ),
        Frame::from_message(&report(), Bytes::new()),
        Frame::from_message(&SyncWeights { weights: report() }, Bytes::new()),
        Frame::from_message(&PullWeights { version: 3 }, Bytes::new()),
        Frame::from_message(
            &WeightsBucket {
                version: 3,
                index: 0,
                count: 1,
                checksum: checksum(&payload),
                tensors: weights.tensors.clone(),
            },
            payload,
        ),
        Frame::from_message(
            &Shutdown {
                reason: "the run finished".into(),
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &ValuesRequest {
                micro_batches: vec![MicroBatch {
                    rows: 1,
                    width: 2,
                    input_ids: vec![1, 2],
                    attention_mask: vec![1, 1],
                    loss_mask: vec![0.0, 1.0],
                    advantages: vec![0.0, 0.5],
                    old_logprobs: vec![0.0, -0.1],
                    loss_scale: 1.0,
                    objective: Objective::Ppo {
                        clip_low: 0.2,
                        clip_high: 0.2,
                        kl_coef: 0.0,
                        temperature: 1.0,
                        value_clip: 0.2,
                        value_coef: 0.5,
                        train_policy: true,
                        correction: RolloutCorrection::default(),
                    },
                    returns: vec![0.0, 1.0],
                    old_values: vec![0.0, 0.25],
                    row_staleness: vec![0],
                }],
            },
            Bytes::new(),
        ),
        Frame::from_message(
            &ValuesResponse {
                values: vec![vec![0.0, 0.25]],
            },
            Bytes::new(),
        ),
        Frame::from_message(&GeneratorMemory::Release, Bytes::new()),
        Frame::from_message(&SealWeights { weights: report() }, Bytes::new()),
        Frame::from_message(
            &Loaded {
                vocabulary: 151_936,
            },
            Bytes::new(),
        ),
    ];
    frames.into_iter().map(Result::unwrap).collect()
}

#[test]
fn every_kind_round_trips_back_to_back() {
    let frames = samples();
    let kinds: Vec<MessageKind> = frames.iter().map(|f| f.kind).collect();
    assert_eq!(kinds, MessageKind::ALL, "one sample per kind");

    let mut wire = BytesMut::new();
    let mut codec = FrameCodec::new();
    for frame in &frames {
        codec.encode(frame.clone(), &mut wire).unwrap();
    }
    for frame in &frames {
        assert_eq!(codec.decode(&mut wire).unwrap().as_ref(), Some(frame));
    }
    assert_eq!(codec.decode_eof(&mut wire).unwrap(), None);
}

#[test]
fn weights_update_payload_checks() {
    let frame = samples()
        .into_iter()
        .find(|f| f.kind == MessageKind::WeightsUpdate)
        .unwrap();
    let update = frame.decode_message::<WeightsUpdate>().unwrap();
    let tensors = update.tensor_bytes(&frame.payload).unwrap();
    assert_eq!(tensors.len(), 1);
    assert_eq!(tensors[0].1, &[1, 2, 3, 4, 5, 6, 7, 8]);

    let mut corrupted = frame.payload.to_vec();
    corrupted[0] ^= 1;
    let err = update.tensor_bytes(&corrupted).unwrap_err();
    assert!(err.to_string().starts_with("payload checksum is "), "{err}");
}

#[test]
fn header_of_another_message_type_is_rejected() {
    for frame in samples() {
        if frame.kind != MessageKind::GenerateRequest {
            let err = frame.decode_message::<GenerateRequest>().unwrap_err();
            assert!(matches!(err, FrameError::KindMismatch { .. }), "{err}");
        }
        if frame.kind != MessageKind::Heartbeat {
            // Ignoring the kind, the JSON itself still does not parse as the wrong type.
            let err = frame.decode_header::<Heartbeat>().unwrap_err();
            assert!(matches!(err, FrameError::InvalidHeader { .. }), "{err}");
        }
    }
}

/// Decodes `bytes`, fed in chunks of `chunk` bytes, until the codec errs or runs dry.
fn drain(mut codec: FrameCodec, bytes: &[u8], chunk: usize) {
    let mut buf = BytesMut::new();
    for piece in bytes.chunks(chunk.max(1)) {
        buf.extend_from_slice(piece);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let _ = codec.decode_eof(&mut buf);
}

fn small_codec() -> FrameCodec {
    FrameCodec::new()
        .with_max_header_bytes(1 << 10)
        .with_max_payload_bytes(1 << 12)
}

fn finite_f32() -> impl Strategy<Value = f32> {
    pf32::POSITIVE | pf32::NEGATIVE | pf32::NORMAL | pf32::SUBNORMAL | pf32::ZERO
}

fn finite_f64() -> impl Strategy<Value = f64> {
    pf64::POSITIVE | pf64::NEGATIVE | pf64::NORMAL | pf64::SUBNORMAL | pf64::ZERO
}

fn finish_reason() -> impl Strategy<Value = FinishReason> {
    prop_oneof![Just(FinishReason::Stop), Just(FinishReason::Length)]
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        finite_f64().prop_map(serde_json::Value::from),
        ".*".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            proptest::collection::btree_map(".*", inner, 0..4)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

prop_compose! {
    fn hello()(role in ".*", name in ".*", version in ".*") -> Hello {
        Hello { role, name, version, credits: 4, info: serde_json::Value::Null }
    }
}

prop_compose! {
    fn sampling()(
        max_new_tokens in any::<u32>(),
        temperature in finite_f32(),
        top_p in finite_f32(),
        top_k in any::<u32>(),
        stop_token_ids in vec(any::<u32>(), 0..4),
        stop_strings in vec(".{0,8}", 0..3),
        ignore_eos in any::<bool>(),
        seed in any::<u64>(),
    ) -> SamplingParams {
        SamplingParams {
            max_new_tokens,
            temperature,
            top_p,
            top_k,
            stop_token_ids,
            stop_strings,
            ignore_eos,
            seed,
        }
    }
}

prop_compose! {
    fn generate_request()(
        prompts in vec((vec(any::<u32>(), 0..16), any::<u32>(), vec(any::<u32>(), 0..4)), 0..4),
        sampling in sampling(),
    ) -> GenerateRequest {
        let prompts = prompts
            .into_iter()
            .map(|(prompt_ids, n, max_new_tokens)| PromptRequest { prompt_ids, n, max_new_tokens, seed: None, group: None })
            .collect();
        GenerateRequest { prompts, sampling }
    }
}

prop_compose! {
    fn completion()(
        token_ids in vec(any::<u32>(), 0..16),
        logprobs in vec(finite_f32(), 0..16),
        finish_reason in finish_reason(),
        weight_version in any::<u64>(),
    ) -> Completion {
        Completion { token_ids, logprobs, finish_reason, weight_version }
    }
}

prop_compose! {
    fn score_request()(
        samples in vec((".*", ".*", json_value(), finish_reason()), 0..4),
    ) -> ScoreRequest {
        let samples = samples
            .into_iter()
            .map(|(prompt, completion, record, finish_reason)| ScoreSample {
                prompt,
                completion,
                record,
                finish_reason,
            })
            .collect();
        ScoreRequest { samples }
    }
}

prop_compose! {
    fn score_response()(
        totals in vec(finite_f64(), 0..8),
        components in vec((".*", finite_f64(), vec(finite_f64(), 0..8)), 0..4),
    ) -> ScoreResponse {
        let components = components
            .into_iter()
            .map(|(name, weight, scores)| RewardComponent { name, weight, scores })
            .collect();
        ScoreResponse { totals, components, failed: Vec::new() }
    }
}

fn objective() -> impl Strategy<Value = Objective> {
    prop_oneof![
        Just(Objective::Sft),
        finite_f32().prop_map(|beta| Objective::Dpo { beta }),
        (
            finite_f32(),
            finite_f32(),
            finite_f32(),
            finite_f32(),
            any::<bool>()
        )
            .prop_map(|(clip_low, clip_high, kl_coef, temperature, in_reward)| {
                Objective::Grpo {
                    clip_low,
                    clip_high,
                    kl_coef,
                    temperature,
                    kl_penalty: if in_reward {
                        KlPenalty::Reward
                    } else {
                        KlPenalty::Loss
                    },
                    correction: RolloutCorrection::default(),
                }
            }),
        (finite_f32(), finite_f32(), finite_f32(), finite_f32()).prop_map(
            |(clip_low, clip_high, kl_coef, temperature)| Objective::Gspo {
                clip_low,
                clip_high,
                kl_coef,
                temperature,
                correction: RolloutCorrection {
                    mode: CorrectionMode::Tis,
                    ..RolloutCorrection::default()
                },
            }
        ),
        (
            (finite_f32(), finite_f32(), finite_f32(), finite_f32()),
            (finite_f32(), finite_f32(), any::<bool>())
        )
            .prop_map(
                |(
                    (clip_low, clip_high, kl_coef, temperature),
                    (value_clip, value_coef, train_policy),
                )| {
                    Objective::Ppo {
                        clip_low,
                        clip_high,
                        kl_coef,
                        temperature,
                        value_clip,
                        value_coef,
                        train_policy,
                        correction: RolloutCorrection::default(),
                    }
                }
            ),
    ]
}

prop_compose! {
    fn micro_batch()(
        rows in any::<usize>(),
        width in any::<usize>(),
        input_ids in vec(any::<u32>(), 0..16),
        attention_mask in vec(any::<u8>(), 0..16),
        loss_mask in vec(finite_f32(), 0..16),
        advantages in vec(finite_f32(), 0..16),
        old_logprobs in vec(finite_f32(), 0..16),
        loss_scale in finite_f32(),
        objective in objective(),
        returns in vec(finite_f32(), 0..16),
        old_values in vec(finite_f32(), 0..16),
        row_staleness in vec(any::<u32>(), 0..4),
    ) -> MicroBatch {
        MicroBatch {
            rows, width, input_ids, attention_mask, loss_mask, advantages, old_logprobs,
            loss_scale, objective, returns, old_values, row_staleness,
        }
    }
}

prop_compose! {
    fn weights_update()(
        version in any::<u64>(),
        tensors in vec((".*", 0usize..Dtype::ALL.len(), vec(0u64..4, 0..3)), 0..4),
    ) -> (WeightsUpdate, Vec<u8>) {
        let mut builder = TensorPayloadBuilder::new();
        for (i, (name, dtype, shape)) in tensors.into_iter().enumerate() {
            let dtype = Dtype::ALL[dtype];
            let len = dtype.byte_len(&shape).unwrap() as usize;
            let data: Vec<u8> = (0..len).map(|b| b as u8).collect();
            builder.push(format!("{i}.{name}"), dtype, shape, &data).unwrap();
        }
        let (tensors, payload) = builder.finish();
        let update = WeightsUpdate { version, checksum: checksum(&payload), tensors };
        (update, payload.to_vec())
    }
}

proptest! {
    #[test]
    fn hello_round_trips(m in hello(), s in any::<Index>()) {
        round_trip(&m, vec![], s.index(256));
    }

    #[test]
    fn heartbeat_round_trips(seq in any::<u64>(), s in any::<Index>()) {
        round_trip(&Heartbeat { seq }, vec![], s.index(64));
    }

    #[test]
    fn error_round_trips(message in ".*", s in any::<Index>()) {
        round_trip(&ErrorMessage { message }, vec![], s.index(256));
    }

    #[test]
    fn generate_request_round_trips(m in generate_request(), s in any::<Index>()) {
        round_trip(&m, vec![], s.index(512));
    }

    #[test]
    fn generate_response_round_trips(
        groups in vec(vec(completion(), 0..3), 0..3),
        metrics in btree_map("[a-z/_]{1,12}", finite_f64(), 0..4),
        s in any::<Index>(),
    ) {
        let producers = Vec::new();
        round_trip(&GenerateResponse { groups, metrics, producers }, vec![], s.index(1024));
    }

    #[test]
    fn score_request_round_trips(m in score_request(), s in any::<Index>()) {
        round_trip(&m, vec![], s.index(1024));
    }

    #[test]
    fn score_response_round_trips(m in score_response(), s in any::<Index>()) {
        round_trip(&m, vec![], s.index(1024));
    }

    #[test]
    fn train_request_round_trips(
        micro_batches in vec(micro_batch(), 0..3),
        learning_rate in finite_f64(),
        epochs in any::<u32>(),
        s in any::<Index>(),
    ) {
        round_trip(&TrainRequest { micro_batches, learning_rate, epochs }, vec![], s.index(2048));
    }

    #[test]
    fn values_round_trip(
        micro_batches in vec(micro_batch(), 0..3),
        values in vec(vec(finite_f32(), 0..16), 0..3),
        s in any::<Index>(),
    ) {
        round_trip(&ValuesRequest { micro_batches }, vec![], s.index(2048));
        round_trip(&ValuesResponse { values }, vec![], s.index(2048));
    }

    #[test]
    fn train_response_round_trips(
        metrics in proptest::collection::btree_map(".*", finite_f64(), 0..8),
        weight_version in any::<u64>(),
        s in any::<Index>(),
    ) {
        let excluded = Vec::new();
        round_trip(&TrainResponse { metrics, weight_version, excluded }, vec![], s.index(1024));
    }

    #[test]
    fn weights_update_round_trips((m, payload) in weights_update(), s in any::<Index>()) {
        m.tensor_bytes(&payload).unwrap();
        round_trip(&m, payload, s.index(1024));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in vec(any::<u8>(), 0..512), chunk in 1usize..64) {
        drain(small_codec(), &bytes, chunk);
        drain(FrameCodec::new(), &bytes, chunk);
    }

    #[test]
    fn arbitrary_preambles_never_panic(
        kind in any::<u16>(),
        flags in prop_oneof![Just(0u16), any::<u16>()],
        header_len in prop_oneof![0u32..64, any::<u32>()],
        payload_len in prop_oneof![0u64..64, any::<u64>()],
        rest in vec(any::<u8>(), 0..256),
        chunk in 1usize..64,
    ) {
        let mut bytes = b"RLT\x01".to_vec();
        bytes.extend_from_slice(&kind.to_be_bytes());
        bytes.extend_from_slice(&flags.to_be_bytes());
        bytes.extend_from_slice(&header_len.to_be_bytes());
        bytes.extend_from_slice(&[0; 4]);
        bytes.extend_from_slice(&payload_len.to_be_bytes());
        bytes.extend_from_slice(&rest);
        drain(small_codec(), &bytes, chunk);
        drain(FrameCodec::new(), &bytes, chunk);
    }

    #[test]
    fn corrupted_frames_never_panic(
        flips in vec((any::<Index>(), any::<u8>()), 1..4),
        chunk in 1usize..64,
    ) {
        let mut wire = BytesMut::new();
        for frame in samples() {
            wire.extend_from_slice(&encode(frame));
        }
        for (at, byte) in flips {
            let i = at.index(wire.len());
            wire[i] ^= byte;
        }
        let mut codec = small_codec();
        let mut buf = BytesMut::new();
        for piece in wire.chunks(chunk) {
            buf.extend_from_slice(piece);
            while let Ok(Some(frame)) = codec.decode(&mut buf) {
                // Headers of frames that still parse are checked, not trusted.
                let _ = frame.decode_header::<serde_json::Value>();
                if let Ok(update) = frame.decode_message::<WeightsUpdate>() {
                    let _ = update.tensor_bytes(&frame.payload);
                }
            }
        }
    }
}
