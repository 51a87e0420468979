//! The `sk_reuseport` program, as instructions: a new connection (or
//! datagram, or a closing listener's queued connection) goes to the socket
//! in slot [`SERVING_SLOT`](super::SERVING_SLOT) of the sockets map, unless
//! its source address and port are in the probes map, which names the slot
//! of the generation being probed. A slot with no socket drops it: nothing
//! falls back to the kernel's spread over every socket of the group, so a
//! generation that was not chosen receives nothing.

use std::net::{IpAddr, SocketAddr};

/// The probes map's key: the source address (IPv4 in its first four
/// bytes, the rest zero) and the source port as the program reads it.
pub(super) const PROBE_KEY_SIZE: u32 = 20;

/// Registers.
const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;
const R4: u8 = 4;
const R5: u8 = 5;
const R6: u8 = 6;
const R7: u8 = 7;
const FP: u8 = 10;

/// `struct sk_reuseport_md` offsets.
const MD_DATA: i16 = 0;
const MD_DATA_END: i16 = 8;
const MD_ETH_PROTOCOL: i16 = 20;

/// Helpers.
const MAP_LOOKUP_ELEM: i32 = 1;
const SKB_LOAD_BYTES_RELATIVE: i32 = 68;
const SK_SELECT_REUSEPORT: i32 = 82;
/// `BPF_HDR_START_NET`.
const FROM_NETWORK_HEADER: i32 = 1;
/// `enum sk_action`.
const SK_DROP: i32 = 0;
const SK_PASS: i32 = 1;

/// Stack: the probe key at fp-24 (address fp-24..fp-8, port fp-8..fp-4),
/// the chosen slot at fp-28.
const KEY_AT: i16 = -24;
const PORT_AT: i16 = -8;
const SLOT_AT: i16 = -28;

/// Where a jump lands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Label {
    V4,
    V6,
    Lookup,
    Select,
    Pass,
}

/// One instruction, or a label's place, before jumps are resolved.
#[derive(Clone, Copy, Debug)]
enum Op {
    Insn(u64),
    /// `code` with its jump offset to be filled in.
    Jump {
        code: u8,
        dst: u8,
        imm: i32,
        to: Label,
    },
    /// A map's descriptor into `dst`: two instruction slots.
    LoadMap {
        dst: u8,
        fd: i32,
    },
    Here(Label),
}

fn encode(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    u64::from(code)
        | (u64::from(dst & 0xf | (src & 0xf) << 4) << 8)
        | (u64::from(off as u16) << 16)
        | (u64::from(imm as u32) << 32)
}

fn mov_reg(dst: u8, src: u8) -> Op {
    Op::Insn(encode(0xbf, dst, src, 0, 0))
}
fn mov_imm(dst: u8, imm: i32) -> Op {
    Op::Insn(encode(0xb7, dst, 0, 0, imm))
}
fn add_imm(dst: u8, imm: i32) -> Op {
    Op::Insn(encode(0x07, dst, 0, 0, imm))
}
fn load_u64(dst: u8, src: u8, off: i16) -> Op {
    Op::Insn(encode(0x79, dst, src, off, 0))
}
fn load_u32(dst: u8, src: u8, off: i16) -> Op {
    Op::Insn(encode(0x61, dst, src, off, 0))
}
fn load_u16(dst: u8, src: u8, off: i16) -> Op {
    Op::Insn(encode(0x69, dst, src, off, 0))
}
fn store_imm_u64(dst: u8, off: i16, imm: i32) -> Op {
    Op::Insn(encode(0x7a, dst, 0, off, imm))
}
fn store_imm_u32(dst: u8, off: i16, imm: i32) -> Op {
    Op::Insn(encode(0x62, dst, 0, off, imm))
}
fn store_u32(dst: u8, src: u8, off: i16) -> Op {
    Op::Insn(encode(0x63, dst, src, off, 0))
}
fn call(helper: i32) -> Op {
    Op::Insn(encode(0x85, 0, 0, 0, helper))
}
fn exit() -> Op {
    Op::Insn(encode(0x95, 0, 0, 0, 0))
}
fn goto(to: Label) -> Op {
    Op::Jump {
        code: 0x05,
        dst: 0,
        imm: 0,
        to,
    }
}
fn if_eq(dst: u8, imm: i32, to: Label) -> Op {
    Op::Jump {
        code: 0x15,
        dst,
        imm,
        to,
    }
}
fn if_ne(dst: u8, imm: i32, to: Label) -> Op {
    Op::Jump {
        code: 0x55,
        dst,
        imm,
        to,
    }
}
/// `if dst > src goto to` (unsigned, registers): `src` rides in `imm`.
fn if_gt_reg(dst: u8, src: u8, to: Label) -> Op {
    Op::Jump {
        code: 0x2d,
        dst,
        imm: i32::from(src),
        to,
    }
}

/// An EtherType as the context's `eth_protocol` holds it (network order,
/// read as a native number).
fn eth_protocol(ethertype: u16) -> i32 {
    i32::from(u16::from_ne_bytes(ethertype.to_be_bytes()))
}

/// The program, with the two maps' descriptors built in.
pub(super) fn instructions(sockets: i32, probes: i32) -> Vec<u64> {
    use Label::*;
    let read_source_address = |offset: i32, len: i32| {
        [
            mov_reg(R1, R6),
            mov_imm(R2, offset),
            mov_reg(R3, FP),
            add_imm(R3, i32::from(KEY_AT)),
            mov_imm(R4, len),
            mov_imm(R5, FROM_NETWORK_HEADER),
            call(SKB_LOAD_BYTES_RELATIVE),
            if_ne(R0, 0, Select),
        ]
    };
    let mut ops = vec![
        mov_reg(R6, R1),
        store_imm_u32(FP, SLOT_AT, super::SERVING_SLOT as i32),
        store_imm_u64(FP, KEY_AT, 0),
        store_imm_u64(FP, KEY_AT + 8, 0),
        store_imm_u32(FP, PORT_AT, 0),
        // The source port: the first two bytes of the TCP or UDP header,
        // if the packet has them (a migrating connection may come with an
        // empty one).
        load_u64(R2, R6, MD_DATA),
        load_u64(R3, R6, MD_DATA_END),
        mov_reg(R4, R2),
        add_imm(R4, 2),
        if_gt_reg(R4, R3, Select),
        load_u16(R4, R2, 0),
        store_u32(FP, R4, PORT_AT),
        load_u32(R7, R6, MD_ETH_PROTOCOL),
        if_eq(R7, eth_protocol(0x0800), V4),
        if_eq(R7, eth_protocol(0x86dd), V6),
        goto(Select),
        Op::Here(V4),
    ];
    // IPv4's source address is at byte 12, IPv6's at byte 8.
    ops.extend(read_source_address(12, 4));
    ops.push(goto(Lookup));
    ops.push(Op::Here(V6));
    ops.extend(read_source_address(8, 16));
    ops.extend([
        Op::Here(Lookup),
        Op::LoadMap {
            dst: R1,
            fd: probes,
        },
        mov_reg(R2, FP),
        add_imm(R2, i32::from(KEY_AT)),
        call(MAP_LOOKUP_ELEM),
        if_eq(R0, 0, Select),
        load_u32(R1, R0, 0),
        store_u32(FP, R1, SLOT_AT),
        Op::Here(Select),
        mov_reg(R1, R6),
        Op::LoadMap {
            dst: R2,
            fd: sockets,
        },
        mov_reg(R3, FP),
        add_imm(R3, i32::from(SLOT_AT)),
        mov_imm(R4, 0),
        call(SK_SELECT_REUSEPORT),
        if_eq(R0, 0, Pass),
        mov_imm(R0, SK_DROP),
        exit(),
        Op::Here(Pass),
        mov_imm(R0, SK_PASS),
        exit(),
    ]);
    assemble(&ops)
}

/// Lays the ops out, resolving each jump to its label.
fn assemble(ops: &[Op]) -> Vec<u64> {
    let width = |op: &Op| match op {
        Op::Insn(_) | Op::Jump { .. } => 1,
        Op::LoadMap { .. } => 2,
        Op::Here(_) => 0,
    };
    let mut at = 0i32;
    let mut labels = Vec::new();
    for op in ops {
        if let Op::Here(label) = op {
            labels.push((*label, at));
        }
        at += width(op);
    }
    let place = |label: Label| {
        labels
            .iter()
            .find(|(l, _)| *l == label)
            .map(|(_, at)| *at)
            .unwrap_or(0)
    };
    let mut out = Vec::new();
    let mut at = 0i32;
    for op in ops {
        match *op {
            Op::Insn(insn) => out.push(insn),
            Op::Jump { code, dst, imm, to } => {
                let off = (place(to) - at - 1) as i16;
                // A register comparison carries its source register, not
                // an immediate.
                let (src, imm) = if code & 0x08 != 0 {
                    (imm as u8, 0)
                } else {
                    (0, imm)
                };
                out.push(encode(code, dst, src, off, imm));
            }
            Op::LoadMap { dst, fd } => {
                // BPF_LD | BPF_DW | BPF_IMM with BPF_PSEUDO_MAP_FD.
                out.push(encode(0x18, dst, 1, 0, fd));
                out.push(0);
            }
            Op::Here(_) => {}
        }
        at += width(op);
    }
    out
}

/// The probes map's key for connections from `source`.
pub(super) fn probe_key(source: SocketAddr) -> [u8; PROBE_KEY_SIZE as usize] {
    let mut key = [0u8; PROBE_KEY_SIZE as usize];
    match source.ip() {
        IpAddr::V4(v4) => key[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => key[..16].copy_from_slice(&v6.octets()),
    }
    // The program stores the port's two bytes, as they are on the wire,
    // zero-extended as a native number.
    let port = u32::from(u16::from_ne_bytes(source.port().to_be_bytes()));
    key[16..].copy_from_slice(&port.to_ne_bytes());
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_jump_lands_on_its_label_and_the_program_ends_in_exits() {
        let insns = instructions(7, 8);
        // Decode back: every jump's target is inside the program and not
        // the second half of a map load.
        let second_halves: Vec<usize> = insns
            .iter()
            .enumerate()
            .filter(|(_, i)| **i & 0xff == 0x18)
            .map(|(at, _)| at + 1)
            .collect();
        for (at, insn) in insns.iter().enumerate() {
            let code = (*insn & 0xff) as u8;
            let is_jump = code & 0x07 == 0x05 && code != 0x85 && code != 0x95;
            if is_jump {
                let off = ((*insn >> 16) & 0xffff) as u16 as i16;
                let target = at as i64 + 1 + i64::from(off);
                assert!(
                    (0..insns.len() as i64).contains(&target),
                    "jump at {at} leaves the program"
                );
                assert!(!second_halves.contains(&(target as usize)));
            }
        }
        assert_eq!(insns.last().map(|i| i & 0xff), Some(0x95));
        // Both maps are built in, as pseudo map descriptors.
        let maps: Vec<u64> = insns
            .iter()
            .filter(|i| **i & 0xff == 0x18)
            .map(|i| i >> 32)
            .collect();
        assert_eq!(maps, vec![8, 7]);
    }

    #[test]
    fn a_probe_key_holds_the_address_and_the_port_as_the_program_reads_them() {
        let key = probe_key("127.0.0.1:40000".parse().expect("address"));
        assert_eq!(&key[..4], &[127, 0, 0, 1]);
        assert_eq!(&key[4..16], &[0; 12]);
        // The wire's bytes of 40000 (0x9c40), zero-extended as a native
        // number: on a little-endian host, the two bytes then two zeros.
        #[cfg(target_endian = "little")]
        assert_eq!(&key[16..], &[0x9c, 0x40, 0, 0]);
        let v6 = probe_key("[::1]:1".parse().expect("address"));
        assert_eq!(v6[15], 1);
    }
}
