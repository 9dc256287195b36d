//! Frames over a real loopback TCP connection with `tokio_util::codec::Framed`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use rollout_net::messages::{GenerateRequest, PromptRequest, SamplingParams, WeightsUpdate};
use rollout_net::tensor::TensorTable;
use rollout_net::{Frame, FrameCodec, FrameError};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::Framed;

const TIMEOUT: Duration = Duration::from_secs(30);

fn request() -> GenerateRequest {
    GenerateRequest {
        prompts: vec![PromptRequest {
            prompt_ids: vec![101, 2023, 2003],
            n: 2,
            max_new_tokens: vec![],
            seed: None,
            group: None,
        }],
        sampling: SamplingParams::plain(32, 7),
    }
}

fn update() -> WeightsUpdate {
    WeightsUpdate {
        version: 3,
        checksum: String::new(),
        tensors: TensorTable::default(),
    }
}

#[tokio::test]
async fn generate_request_echoes_over_loopback() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // Echoes every frame back until the client hangs up.
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await?;
        let mut framed = Framed::new(stream, FrameCodec::new());
        while let Some(frame) = framed.next().await {
            framed.send(frame?).await?;
        }
        Ok::<_, FrameError>(())
    });

    let mut client = Framed::new(TcpStream::connect(addr).await.unwrap(), FrameCodec::new());
    // A payload bigger than the decoder reserves ahead, so its buffer grows as bytes arrive.
    let payload: Bytes = (0..20u32 << 20).map(|i| i as u8).collect();
    let frames = [
        Frame::from_message(&request(), Bytes::new()).unwrap(),
        Frame::from_message(&update(), payload).unwrap(),
    ];
    for frame in frames {
        client.send(frame.clone()).await.unwrap();
        let reply = tokio::time::timeout(TIMEOUT, client.next())
            .await
            .expect("echo in time")
            .expect("a frame")
            .unwrap();
        assert!(reply == frame);
    }
    drop(client);
    tokio::time::timeout(TIMEOUT, server)
        .await
        .expect("server ends")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn garbage_from_a_peer_is_a_typed_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client = tokio::spawn(async move {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        stream
    });
    let (stream, peer) = listener.accept().await.unwrap();
    let mut framed = Framed::new(stream, FrameCodec::new());
    let err = tokio::time::timeout(TIMEOUT, framed.next())
        .await
        .expect("rejected in time")
        .expect("an item")
        .unwrap_err();
    let line = format!("peer {peer} sent a bad frame: {err}");
    assert!(line.ends_with("bad magic bytes \"GET\", expected \"RLT\" (not a Rollout peer?)"));
    drop(client.await.unwrap());
}
