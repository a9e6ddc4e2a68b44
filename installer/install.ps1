<#
.SYNOPSIS
  Krasis installer for Windows: builds krasis.exe and krasis-runtime.exe from
  this source tree and installs them into a prefix
  (default: %LOCALAPPDATA%\Programs\krasis\bin). Safe to run again;
  -Uninstall removes them.

.EXAMPLE
  powershell -ExecutionPolicy Bypass -File installer\install.ps1
  powershell -ExecutionPolicy Bypass -File installer\install.ps1 -Prefix C:\tools\krasis -InstallRust
  powershell -ExecutionPolicy Bypass -File installer\install.ps1 -Uninstall
#>
[CmdletBinding()]
param(
    [string]$Prefix = (Join-Path $env:LOCALAPPDATA "Programs\krasis\bin"),
    [string]$TargetDir = $env:CARGO_TARGET_DIR,
    [switch]$DebugBuild,
    [switch]$InstallRust,
    [switch]$Uninstall,
    # Do not add the prefix to the user's PATH.
    [switch]$NoPath
)

$ErrorActionPreference = "Stop"
$Bins = @("krasis.exe", "krasis-runtime.exe")

function Say([string]$m) { Write-Host "==> $m" }
function Warn([string]$m) { Write-Warning $m }
function Die([string]$m) { Write-Host "error: $m" -ForegroundColor Red; exit 1 }

if ($Uninstall) {
    $removed = $false
    foreach ($b in $Bins) {
        $p = Join-Path $Prefix $b
        if (Test-Path $p) { Remove-Item -Force $p; Say "removed $p"; $removed = $true }
    }
    if (-not $removed) { Say "nothing to remove in $Prefix" }
    exit 0
}

$Repo = Split-Path -Parent $PSScriptRoot
if (-not (Test-Path (Join-Path $Repo "Cargo.toml")) -or -not (Test-Path (Join-Path $Repo "launcher"))) {
    Die "run this script from a Krasis source tree (no Cargo.toml next to installer\ in $Repo)"
}

# Rust toolchain.
$cargoHome = Join-Path $env:USERPROFILE ".cargo\bin"
if (-not (Get-Command cargo -ErrorAction SilentlyContinue) -and (Test-Path (Join-Path $cargoHome "cargo.exe"))) {
    $env:PATH = "$cargoHome;$env:PATH"
}
if (-not (Get-Command cargo -ErrorAction SilentlyContinue)) {
    if ($InstallRust) {
        Say "installing Rust with rustup-init.exe (https://rustup.rs)"
        $init = Join-Path $env:TEMP "rustup-init.exe"
        try {
            Invoke-WebRequest -UseBasicParsing -Uri "https://win.rustup.rs/x86_64" -OutFile $init
        } catch {
            Die "could not download rustup-init.exe ($_); install Rust from https://rustup.rs and run this script again"
        }
        & $init -y --profile minimal
        if ($LASTEXITCODE -ne 0) { Die "rustup-init failed; install Rust from https://rustup.rs" }
        $env:PATH = "$cargoHome;$env:PATH"
    } else {
        Die "cargo not found. Install Rust from https://rustup.rs, or run this script with -InstallRust"
    }
}
Say ("using " + (& cargo --version))

# Build.
$profileDir = if ($DebugBuild) { "debug" } else { "release" }
$buildArgs = @("build", "-p", "krasis", "-p", "krasis-runtime", "--manifest-path", (Join-Path $Repo "Cargo.toml"))
if (-not $DebugBuild) { $buildArgs += "--release" }
if ($TargetDir) { $buildArgs += @("--target-dir", $TargetDir) } else { $TargetDir = Join-Path $Repo "target" }
Say "building ($profileDir) in $TargetDir"
& cargo @buildArgs
if ($LASTEXITCODE -ne 0) { Die "the build failed (see above)" }

# Install: copy beside the destination, then move into place.
New-Item -ItemType Directory -Force -Path $Prefix | Out-Null
foreach ($b in $Bins) {
    $src = Join-Path $TargetDir (Join-Path $profileDir $b)
    if (-not (Test-Path $src)) { Die "$src was not built" }
    $dst = Join-Path $Prefix $b
    $tmp = Join-Path $Prefix ".$b.install-$PID"
    Copy-Item -Force $src $tmp
    Move-Item -Force $tmp $dst
    Say "installed $dst"
}

# Checks that do not fail the install.
$smi = Get-Command nvidia-smi -ErrorAction SilentlyContinue
if ($smi) {
    $ver = & nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>$null | Select-Object -First 1
    if ($LASTEXITCODE -eq 0 -and $ver) { Say "NVIDIA driver: $ver" }
    else { Warn "nvidia-smi did not report a GPU; only the CPU reference backend will run." }
} else {
    Warn "no NVIDIA driver found (nvidia-smi); only the CPU reference backend will run. 'krasis demo' still works."
}

$userPath = [Environment]::GetEnvironmentVariable("PATH", "User")
$onPath = ($userPath -split ";") -contains $Prefix
if (-not $onPath) {
    if ($NoPath) {
        Warn "$Prefix is not on your PATH"
    } else {
        $newPath = if ($userPath) { "$userPath;$Prefix" } else { $Prefix }
        [Environment]::SetEnvironmentVariable("PATH", $newPath, "User")
        Say "added $Prefix to your user PATH (open a new terminal to use it)"
    }
}
Say "done. Try: krasis demo"
