// Recoverable errors: Status (ok or a one-line message) and Result<T> (a value or a Status).
// The library returns these for bad files, bad configs and unsupported requests; the CLI turns
// them into one line on stderr and a non-zero exit. Invariant violations use NIB_CHECK instead.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace nibble {

enum class StatusCode { kOk = 0, kInvalidArgument, kNotFound, kIoError, kDataLoss, kUnimplemented, kInternal };

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename... Args>
Status invalid_argument(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kInvalidArgument, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status not_found(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kNotFound, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status io_error(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kIoError, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status data_loss(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kDataLoss, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status unimplemented(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kUnimplemented, fmt::format(f, std::forward<Args>(args)...)};
}

// A value of type T, or the Status that says why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}            // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}     // NOLINT: must not be ok
  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace nibble

// Return early with the status if it is not ok.
#define NIB_RETURN_IF_ERROR(expr)                    \
  do {                                               \
    ::nibble::Status nib_status_ = (expr);           \
    if (!nib_status_.is_ok()) return nib_status_;    \
  } while (0)

#define NIB_CONCAT_INNER_(a, b) a##b
#define NIB_CONCAT_(a, b) NIB_CONCAT_INNER_(a, b)
// NIB_ASSIGN_OR_RETURN(auto x, make_result()): binds the value or returns the status.
#define NIB_ASSIGN_OR_RETURN(lhs, expr)                                          \
  auto NIB_CONCAT_(nib_result_, __LINE__) = (expr);                              \
  if (!NIB_CONCAT_(nib_result_, __LINE__).is_ok())                               \
    return NIB_CONCAT_(nib_result_, __LINE__).status();                          \
  lhs = std::move(NIB_CONCAT_(nib_result_, __LINE__)).value()
