// The SIGINT/SIGTERM flag (core/interrupt.h): the first signal is recorded and the process goes
// on; the same signal again within the grace second (a process-group duplicate, as GNU timeout
// sends) is ignored; a signal after the grace second ends the process with the default action.
#include "core/interrupt.h"

#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <thread>
#include <unistd.h>

namespace nibble {
namespace {

TEST(Interrupt, FirstSignalIsRecordedAndTheProcessGoesOn) {
  install_interrupt_handlers();
  clear_interrupt();
  ASSERT_EQ(interrupt_signal(), 0);
  raise(SIGTERM);
  EXPECT_EQ(interrupt_signal(), SIGTERM);
  EXPECT_EQ(interrupt_exit_code(), 143);
  clear_interrupt();
}

// GNU timeout signals the command and then its whole process group: the command gets SIGINT twice
// within microseconds. With a reset-on-first-signal handler the second one killed a training run
// before it could checkpoint (seen on the H200: a reproduction arm lost 105 steps).
TEST(Interrupt, ARepeatWithinTheGraceSecondIsIgnored) {
  install_interrupt_handlers();
  clear_interrupt();
  raise(SIGINT);
  raise(SIGINT);
  kill(getpid(), SIGINT);
  EXPECT_EQ(interrupt_signal(), SIGINT);
  EXPECT_EQ(interrupt_exit_code(), 130);
  clear_interrupt();
}

TEST(InterruptDeathTest, ASecondSignalAfterTheGraceSecondEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        install_interrupt_handlers();
        clear_interrupt();
        raise(SIGINT);
        std::this_thread::sleep_for(std::chrono::milliseconds(1100));
        raise(SIGINT);
        _exit(0);  // reached only if the second signal was ignored
      },
      testing::KilledBySignal(SIGINT), "");
}

}  // namespace
}  // namespace nibble
