//! Feeds arbitrary bytes to the frame decoder in both directions, in two chunks (so the
//! incremental path is exercised), and re-encodes whatever decodes. It must never panic, never
//! buffer past one frame, and whatever decodes must survive an encode/decode round trip.
#![no_main]

use imp_guest::frame::{FrameDecoder, encode};
use imp_guest::protocol::{GuestToHost, HostToGuest, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(0, |b| *b as usize % (data.len() + 1));
    decode_all::<HostToGuest>(data, split, |msg| {
        let bytes = encode(msg).expect("a decoded message re-encodes");
        let mut dec = FrameDecoder::with_buffered(bytes);
        assert_eq!(
            dec.decode_next::<HostToGuest>().unwrap().as_ref(),
            Some(msg)
        );
    });
    // Guest messages carry floats, whose text form need not round-trip bit for bit; require
    // only that they re-encode and decode again.
    decode_all::<GuestToHost>(data, split, |msg| {
        let bytes = encode(msg).expect("a decoded message re-encodes");
        let mut dec = FrameDecoder::with_buffered(bytes);
        assert!(dec.decode_next::<GuestToHost>().unwrap().is_some());
    });
});

fn decode_all<M: Message>(data: &[u8], split: usize, check: impl Fn(&M)) {
    let mut dec = FrameDecoder::new();
    dec.extend(&data[..split]);
    let mut rest_fed = false;
    loop {
        match dec.decode_next::<M>() {
            Ok(Some(msg)) => check(&msg),
            Ok(None) if !rest_fed => {
                dec.extend(&data[split..]);
                rest_fed = true;
            }
            Ok(None) => break,
            Err(e) if e.is_recoverable() => {}
            // TooLarge: the connection would be closed here.
            Err(_) => break,
        }
        // Consumed bytes are dropped, never duplicated.
        assert!(dec.buffered() <= data.len());
    }
}
