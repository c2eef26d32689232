// Fuzz target: the TCP handshake's checks (transport/tcp/handshake.h) on what a stranger sends.
//
// Input: a Hello, a Challenge and a Proof as they would arrive (missing bytes read as zero), then
// the rest as the job token. For any bytes:
//   - hello_problem names a problem or none, never crashes, and accepts only fields a rank of
//     this job could send;
//   - the acceptor accepts the Proof only if it is the proof made with the token (the fuzzer
//     cannot forge an HMAC; this checks the comparison, not the hash);
//   - the connector accepts a Challenge made with the token by the rank it dialled, and no other
//     rank's.
#include <string>

#include "fuzz_input.h"
#include "transport/tcp/handshake.h"

using namespace ringcomm::tcp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const Hello hello = in.take<Hello>();
  const Challenge challenge = in.take<Challenge>();
  const Proof proof = in.take<Proof>();
  std::string token = "the job token";
  if (in.left() > 0) {
    size_t n = in.left();
    auto rest = in.bytes(n);
    token.assign(rest.get(), n);
  }
  const int world = 4, acceptor = 1, sockets = 2;

  const std::string problem = hello_problem(hello, world, acceptor, sockets);
  if (problem.empty())
    FUZZ_CHECK(hello.magic == kHandshakeMagic && hello.version == kProtocolVersion &&
               hello.world_size == world && hello.rank > acceptor && hello.rank < world &&
               hello.socket >= 0 && hello.socket < sockets);

  const Proof genuine = make_proof(token, hello, challenge);
  const bool forged = std::memcmp(proof.mac, genuine.mac, sizeof proof.mac) != 0;
  FUZZ_CHECK(proof_valid(token, hello, challenge, proof) ==
             (!forged && proof.magic == kHandshakeMagic));
  FUZZ_CHECK(proof_valid(token, hello, challenge, genuine));

  const Challenge mine = make_challenge(token, hello, acceptor);
  FUZZ_CHECK(challenge_valid(token, hello, mine, acceptor));
  FUZZ_CHECK(!challenge_valid(token, hello, mine, acceptor + 1));
  FUZZ_CHECK(!challenge_valid(token, hello, challenge, acceptor) || challenge.rank == acceptor);
  return 0;
}
