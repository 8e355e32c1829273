/*
 * Preloaded into tritonserver (LD_PRELOAD, controlplane/triton/defer_shim.py): makes libevhtp's hand-off
 * of a response to an HTTP worker thread wait instead of being lost.
 *
 * Triton's HTTP frontend (libevhtp) passes each streamed response of a generate_stream request to the
 * connection's worker thread with evthr_defer(): one 17-byte command written with send() to a
 * non-blocking AF_UNIX stream socketpair. When the worker thread falls ~280 commands behind (a socket
 * buffer's worth: the thread descheduled on a busy machine, or running a model load, which Triton does
 * on the HTTP thread of the connection asking for it, while a model keeps streaming) send() fails with
 * EAGAIN, evthr_defer() returns an error, Triton ignores it, and the
 * command is gone: a lost token, or a lost end of the stream, which then never ends (a client or
 * proxy waits until its idle timeout).
 *
 * This send() waits for room (poll) and sends again, for exactly that case: a 17-byte send with no
 * flags on an AF_UNIX stream socket that failed with EAGAIN. The waiting thread is the one handing the
 * response over (the model's response thread), so a model streaming faster than the frontend writes
 * is slowed down instead of losing output. After WAIT_LIMIT_MS without room it gives up as before.
 * Every other send() is the real one, untouched. The library removes itself from LD_PRELOAD when it
 * loads, so Triton's children (python stubs, user code) never see it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

#define EVTHR_CMD_BYTES 17 /* libevhtp's packed struct evthr_cmd on a 64-bit machine */
#define WAIT_STEP_MS 50
#define WAIT_LIMIT_MS 30000
#define SELF_NAME "snooze_defer_send"

typedef ssize_t (*send_fn)(int, const void *, size_t, int);

static send_fn real_send;

__attribute__((constructor)) static void snooze_defer_send_init(void)
{
  real_send = (send_fn)dlsym(RTLD_NEXT, "send");
  /* Take this library out of LD_PRELOAD for the processes Triton starts (entries are ':' or ' '
     separated; only ours is removed). */
  const char *preload = getenv("LD_PRELOAD");
  if (preload == NULL || strstr(preload, SELF_NAME) == NULL) {
    return;
  }
  char *copy = strdup(preload);
  char *kept = calloc(strlen(preload) + 1, 1);
  if (copy == NULL || kept == NULL) {
    free(copy);
    free(kept);
    return;
  }
  char *save = NULL;
  for (char *entry = strtok_r(copy, ": ", &save); entry != NULL; entry = strtok_r(NULL, ": ", &save)) {
    if (strstr(entry, SELF_NAME) != NULL) {
      continue;
    }
    if (kept[0] != '\0') {
      strcat(kept, ":");
    }
    strcat(kept, entry);
  }
  if (kept[0] == '\0') {
    unsetenv("LD_PRELOAD");
  } else {
    setenv("LD_PRELOAD", kept, 1);
  }
  free(copy);
  free(kept);
}

static int is_unix_stream(int fd)
{
  int value = 0;
  socklen_t size = sizeof value;
  if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &value, &size) != 0 || value != AF_UNIX) {
    return 0;
  }
  size = sizeof value;
  return getsockopt(fd, SOL_SOCKET, SO_TYPE, &value, &size) == 0 && value == SOCK_STREAM;
}

ssize_t send(int fd, const void *buf, size_t len, int flags)
{
  if (real_send == NULL) {
    real_send = (send_fn)dlsym(RTLD_NEXT, "send");
  }
  ssize_t sent = real_send(fd, buf, len, flags);
  if (sent >= 0 || len != EVTHR_CMD_BYTES || flags != 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
    return sent;
  }
  int saved = errno;
  if (!is_unix_stream(fd)) {
    errno = saved;
    return sent;
  }
  for (int waited = 0; waited < WAIT_LIMIT_MS; waited += WAIT_STEP_MS) {
    struct pollfd room = {.fd = fd, .events = POLLOUT, .revents = 0};
    if (poll(&room, 1, WAIT_STEP_MS) < 0 && errno != EINTR) {
      break;
    }
    sent = real_send(fd, buf, len, flags);
    if (sent >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
      return sent;
    }
  }
  errno = EAGAIN;
  return -1;
}
