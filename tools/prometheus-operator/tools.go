//go:build tools

// The commands tools/build.sh builds from this module: importing them keeps `go mod tidy` from
// dropping what they need.
package tools

import (
	_ "github.com/prometheus-operator/prometheus-operator/cmd/operator"
)
