// The handshake on every new TCP connection, before any message. The connecting (higher) rank
// proves that it knows the job token and the accepting rank proves it back, without either one
// sending the token (docs/security.md):
//   1. connector -> acceptor  Hello:     who it is (rank, socket, world size, protocol version)
//                                        and a fresh 32-byte nonce, N_c.            64 bytes
//   2. acceptor -> connector  Challenge: its rank, a fresh nonce N_a and
//                                        HMAC-SHA256(token, "acceptor", Hello, N_a, rank).  80
//                                        bytes
//                             or a refusal Reply (a field of the Hello is wrong for this job).
//   3. connector -> acceptor  Proof:     HMAC-SHA256(token, "connector", Hello, N_a).      40 bytes
//   4. acceptor -> connector  Reply:     accepted or refused.                              12 bytes
// Fresh nonces on both sides make a recorded exchange useless for another connection; the two
// labels keep one side's answer from serving as the other's. Hello's first three fields and
// Reply's three keep their places in every protocol version, so ranks running different versions
// refuse each other with a clear error.
#pragma once

#include <cstdint>
#include <string>

#include "common/crypto.h"

namespace ringcomm {
namespace tcp {

constexpr uint32_t kHandshakeMagic = 0x524d4348;  // "RMCH"
// Bumped whenever the bytes between ranks change meaning (handshake, headers, slots, setup
// exchanges).
constexpr uint32_t kProtocolVersion = 4;
constexpr uint32_t kByteOrder = 0x01020304;  // as written by the sender

struct Hello {
  uint32_t magic;
  uint32_t byte_order;
  uint32_t version;
  uint32_t reserved;
  int32_t world_size;
  int32_t rank;
  int32_t socket;
  int32_t sockets_per_peer;
  uint8_t nonce[32];
};
struct Reply {
  uint32_t magic;
  int32_t accepted;
  uint32_t version;  // the acceptor's kProtocolVersion
};
struct Challenge {
  Reply reply;  // accepted = 1: go on with the proof
  int32_t rank;
  uint8_t nonce[32];
  uint8_t mac[32];
};
struct Proof {
  uint32_t magic;
  uint32_t reserved;
  uint8_t mac[32];
};
static_assert(sizeof(Hello) == 64 && sizeof(Reply) == 12 && sizeof(Challenge) == 80 &&
                  sizeof(Proof) == 40,
              "handshake messages have fixed sizes on the wire");

Hello make_hello(int world_size, int rank, int socket, int sockets_per_peer);
// Why `acceptor` (of `world_size` ranks, `sockets_per_peer` sockets each) must refuse `h`, or ""
// if its fields are right. Says nothing of the token: that is the Proof's part.
std::string hello_problem(const Hello& h, int world_size, int acceptor, int sockets_per_peer);
Challenge make_challenge(const std::string& token, const Hello& h, int acceptor);
// The connector's checks of the Challenge: the acceptor knows the token and is rank `acceptor`.
bool challenge_valid(const std::string& token, const Hello& h, const Challenge& c, int acceptor);
Proof make_proof(const std::string& token, const Hello& h, const Challenge& c);
bool proof_valid(const std::string& token, const Hello& h, const Challenge& c, const Proof& p);

}  // namespace tcp
}  // namespace ringcomm
