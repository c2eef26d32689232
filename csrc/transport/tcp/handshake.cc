#include "transport/tcp/handshake.h"

#include <string.h>

#include "common/error.h"

namespace ringcomm {
namespace tcp {
namespace {

constexpr char kAcceptorLabel[] = "ringcomm acceptor";
constexpr char kConnectorLabel[] = "ringcomm connector";

Digest acceptor_mac(const std::string& token, const Hello& h, const uint8_t* nonce, int32_t rank) {
  return hmac_sha256(
      token,
      {{kAcceptorLabel, sizeof kAcceptorLabel}, {&h, sizeof h}, {nonce, 32}, {&rank, sizeof rank}});
}

Digest connector_mac(const std::string& token, const Hello& h, const uint8_t* nonce) {
  return hmac_sha256(token,
                     {{kConnectorLabel, sizeof kConnectorLabel}, {&h, sizeof h}, {nonce, 32}});
}

}  // namespace

Hello make_hello(int world_size, int rank, int socket, int sockets_per_peer) {
  Hello h{kHandshakeMagic,  kByteOrder, kProtocolVersion, 0, world_size, rank, socket,
          sockets_per_peer, {}};
  random_bytes(h.nonce, sizeof h.nonce);
  return h;
}

std::string hello_problem(const Hello& h, int world_size, int acceptor, int sockets_per_peer) {
  if (h.magic != kHandshakeMagic) return "not a ringcomm handshake";
  if (h.version != kProtocolVersion)
    return str_cat("rank ", h.rank, " runs ringcomm protocol version ", h.version, ", rank ",
                   acceptor, " version ", kProtocolVersion,
                   ": every rank must run the same ringcomm");
  if (h.byte_order != kByteOrder) return "a peer of the other byte order";
  if (h.world_size != world_size)
    return str_cat("rank ", h.rank, " was started with world size ", h.world_size, ", rank ",
                   acceptor, " with ", world_size);
  if (h.sockets_per_peer != sockets_per_peer)
    return str_cat("rank ", h.rank, " uses ", h.sockets_per_peer, " sockets per peer, rank ",
                   acceptor, " ", sockets_per_peer, " (RINGCOMM_SOCKETS_PER_PEER differs)");
  if (h.rank <= acceptor || h.rank >= world_size || h.socket < 0 || h.socket >= sockets_per_peer)
    return str_cat("a connection claiming rank ", h.rank, " socket ", h.socket,
                   ", which does not connect to rank ", acceptor);
  return "";
}

Challenge make_challenge(const std::string& token, const Hello& h, int acceptor) {
  Challenge c{{kHandshakeMagic, 1, kProtocolVersion}, acceptor, {}, {}};
  random_bytes(c.nonce, sizeof c.nonce);
  Digest mac = acceptor_mac(token, h, c.nonce, c.rank);
  memcpy(c.mac, mac.data(), mac.size());
  return c;
}

bool challenge_valid(const std::string& token, const Hello& h, const Challenge& c, int acceptor) {
  Digest mac = acceptor_mac(token, h, c.nonce, c.rank);
  return equal_in_constant_time(mac.data(), c.mac, mac.size()) && c.rank == acceptor;
}

Proof make_proof(const std::string& token, const Hello& h, const Challenge& c) {
  Proof p{kHandshakeMagic, 0, {}};
  Digest mac = connector_mac(token, h, c.nonce);
  memcpy(p.mac, mac.data(), mac.size());
  return p;
}

bool proof_valid(const std::string& token, const Hello& h, const Challenge& c, const Proof& p) {
  Digest mac = connector_mac(token, h, c.nonce);
  return equal_in_constant_time(mac.data(), p.mac, mac.size()) && p.magic == kHandshakeMagic;
}

}  // namespace tcp
}  // namespace ringcomm
